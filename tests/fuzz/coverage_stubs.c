/* GCC's -fsanitize-coverage=trace-cmp also reports floating-point comparisons, which
 * libFuzzer does not take: these hooks let the fuzzing build of the C lane load
 * (tests/fuzz/campaign.py); libFuzzer's own take the integer ones. */
void __sanitizer_cov_trace_cmpd(double a, double b) { (void)a; (void)b; }
void __sanitizer_cov_trace_cmpf(float a, float b) { (void)a; (void)b; }
