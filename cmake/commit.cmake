# Writes OUT (a header defining KVS_COMMIT) from the git commit of SRC, only when it changes,
# so the bench reports the commit it was built from.
execute_process(COMMAND git -C "${SRC}" rev-parse --short HEAD OUTPUT_VARIABLE c
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
execute_process(COMMAND git -C "${SRC}" status --porcelain --untracked-files=no OUTPUT_VARIABLE d
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT c)
  set(c unknown)
endif()
if(d)
  set(c "${c}-dirty")
endif()
set(txt "#define KVS_COMMIT \"${c}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL txt)
  file(WRITE "${OUT}" "${txt}")
endif()
