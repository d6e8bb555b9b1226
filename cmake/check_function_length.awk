# awk -f cmake/check_function_length.awk src/**/*.c
# Fails (exit 1) naming every function of more than 120 lines: a function starts at a line at
# column 0 that ends its signature with "{" and ends at the next "}" at column 0 (the style of
# this tree; .clang-format keeps it so).
/^[A-Za-z_][^;]*\)[ \t]*\{[ \t]*$/ && !/^(if|for|while|switch|else|do)[ (]/ { name = $0; start = FNR; next }
/^\}/ {
    if (start) {
        len = FNR - start + 1
        if (len > 120) { printf "%s:%d: %d lines (at most 120): %s\n", FILENAME, start, len, name; bad++ }
        start = 0
    }
}
END { if (bad) { printf "check_function_length: %d function(s) too long\n", bad; exit 1 } }
