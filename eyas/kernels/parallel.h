/* Loops over rows that take OpenMP threads only where they have them. A parallel region costs about 0.33 us even on
   one thread (libgomp sets up a team of one), and a batch-1 decode step of the default model opened about 400 of
   them (norms, rotary, SiLU, each product's quantization and product): on one thread these loops run without
   entering OpenMP. Both forms run every row the same way, so results do not depend on which one ran. */
#pragma once

/* for (int64_t VAR = 0; VAR < COUNT; VAR++) BODY, on the caller's num_threads when WORTH and there are two or
   more, else on the calling thread */
#define PARALLEL_ROWS(VAR, COUNT, WORTH, ...)                                                       \
    do {                                                                                            \
        if (num_threads > 1 && (WORTH)) {                                                           \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                   \
            for (int64_t VAR = 0; VAR < (COUNT); VAR++) __VA_ARGS__                                 \
        } else {                                                                                    \
            for (int64_t VAR = 0; VAR < (COUNT); VAR++) __VA_ARGS__                                 \
        }                                                                                           \
    } while (0)

/* CALL (a function whose loops are orphaned `omp for`s) in a parallel region of num_threads, or on the calling
   thread alone where there is one: an orphaned `omp for` outside a region runs every iteration on that thread */
#define PARALLEL_CALL(CALL)                                                                         \
    do {                                                                                            \
        if (num_threads > 1) {                                                                      \
            _Pragma("omp parallel num_threads(num_threads)")                                        \
            CALL;                                                                                   \
        } else {                                                                                    \
            CALL;                                                                                   \
        }                                                                                           \
    } while (0)
