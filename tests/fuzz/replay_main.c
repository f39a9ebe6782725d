/* Runs a fuzz target without libFuzzer: every file of a seed corpus as is, then a fixed
 * number of deterministic mutations of those seeds (byte flips, truncations, insertions,
 * interesting integers). Under ASan/UBSan any memory error aborts the test. The input that
 * aborted is written to fuzz-failure.bin in the working folder (replay it with a corpus folder
 * holding only that file, and MUTATIONS 0).
 * usage: fuzz_X_replay CORPUS_DIR [MUTATIONS] */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t next_random(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct seed { uint8_t *data; size_t size; } seed;

static int load_file(const char *path, seed *out)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    if (fseek(f, 0, SEEK_END) != 0) { fclose(f); return -1; }
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) { fclose(f); return -1; }
    out->data = malloc((size_t)n + 1);
    if (!out->data) { fclose(f); return -1; }
    out->size = fread(out->data, 1, (size_t)n, f);
    fclose(f);
    return out->size == (size_t)n ? 0 : -1;
}

static void mutate(uint8_t *buf, size_t *size, size_t cap)
{
    int rounds = 1 + (int)(next_random() % 4);
    for (int r = 0; r < rounds; r++) {
        size_t n = *size;
        switch (next_random() % 6) {
        case 0: if (n) buf[next_random() % n] ^= (uint8_t)(1u << (next_random() % 8)); break;
        case 1: if (n) buf[next_random() % n] = (uint8_t)next_random(); break;
        case 2: if (n) *size = next_random() % n; break;                      /* truncate */
        case 3: if (n + 1 < cap) {                                            /* insert a byte */
                    size_t at = n ? next_random() % n : 0;
                    memmove(buf + at + 1, buf + at, n - at);
                    buf[at] = (uint8_t)next_random();
                    (*size)++;
                } break;
        case 4: if (n >= 8) {                                                 /* interesting u64 */
                    static const uint64_t vals[] = {0, 1, 0x7f, 0xff, 0xffff, 0x7fffffff,
                                                    0xffffffff, 0x100000000ull, UINT64_MAX,
                                                    (uint64_t)INT64_MAX};
                    uint64_t v = vals[next_random() % (sizeof vals / sizeof vals[0])];
                    size_t at = next_random() % (n - 7);
                    memcpy(buf + at, &v, 8 - (next_random() % 2) * 4);
                } break;
        case 5: if (n >= 4) {                                                 /* interesting u32 */
                    uint32_t v = (uint32_t)(next_random() % 2 ? next_random() % 64 : next_random());
                    memcpy(buf + next_random() % (n - 3), &v, 4);
                } break;
        }
    }
}

static const uint8_t *running;
static size_t running_size;

static void save_failure(int sig)
{
    static const char msg[] = "replay: the failing input is in fuzz-failure.bin\n";
    int fd = open("fuzz-failure.bin", O_WRONLY | O_CREAT | O_TRUNC, 0644);   /* async-signal-safe calls */
    if (fd >= 0) {
        ssize_t w = write(fd, running, running_size);
        w = write(STDERR_FILENO, msg, sizeof msg - 1);
        (void)w;
        close(fd);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void run_one(const uint8_t *data, size_t size)
{
    running = data;
    running_size = size;
    LLVMFuzzerTestOneInput(data, size);
}

int main(int argc, char **argv)
{
    signal(SIGABRT, save_failure);
    signal(SIGSEGV, save_failure);
    if (argc < 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR [MUTATIONS]\n", argv[0]);
        return 2;
    }
    long mutations = argc > 2 ? strtol(argv[2], NULL, 10) : 10000;
    DIR *dir = opendir(argv[1]);
    if (!dir) {
        fprintf(stderr, "cannot open corpus %s\n", argv[1]);
        return 2;
    }
    seed *seeds = NULL;
    size_t n_seeds = 0;
    struct dirent *de;
    while ((de = readdir(dir))) {
        if (de->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", argv[1], de->d_name);
        seed s;
        if (load_file(path, &s) != 0) {
            fprintf(stderr, "cannot read %s\n", path);
            return 2;
        }
        seed *grown = realloc(seeds, (n_seeds + 1) * sizeof *seeds);
        if (!grown)
            return 2;
        seeds = grown;
        seeds[n_seeds++] = s;
    }
    closedir(dir);
    if (n_seeds == 0) {
        fprintf(stderr, "corpus %s is empty\n", argv[1]);
        return 2;
    }
    size_t max = 0;
    for (size_t i = 0; i < n_seeds; i++) {
        run_one(seeds[i].data, seeds[i].size);
        if (seeds[i].size > max)
            max = seeds[i].size;
    }
    size_t cap = max + 64;
    uint8_t *buf = malloc(cap);
    if (!buf)
        return 2;
    for (long m = 0; m < mutations; m++) {
        const seed *s = &seeds[next_random() % n_seeds];
        memcpy(buf, s->data, s->size);
        size_t size = s->size;
        mutate(buf, &size, cap);
        /* an exact-size heap copy so ASan sees reads past the end */
        uint8_t *exact = malloc(size ? size : 1);
        if (!exact)
            return 2;
        memcpy(exact, buf, size);
        run_one(exact, size);
        free(exact);
    }
    printf("%zu seeds and %ld mutations ran without a fault\n", n_seeds, mutations);
    free(buf);
    for (size_t i = 0; i < n_seeds; i++)
        free(seeds[i].data);
    free(seeds);
    return 0;
}
