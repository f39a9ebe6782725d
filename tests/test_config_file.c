/* Config files (coordinator/config/config_file.h): a YAML file and the JSON file of the same
 * settings read into equal documents (checked with jansson's own json_equal); how YAML's plain
 * and quoted scalars become values; and each refusal with its line: syntax, a duplicate key, a
 * key that is a list, a second document, a NUL inside a value or a key, nesting too deep, an alias bomb;
 * a directory, a missing file, a JSON syntax error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "coordinator/config/config_file.h"
#include "tests/test_dir.h"

static char dir[64];

static int make_dir(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/strata-config-XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int remove_dir(void **state)
{
    (void)state;
    test_dir_remove_tree(dir);
    return 0;
}

/* Writes text to dir/name; returns the path (static buffer: one at a time). */
static const char *file_with(const char *name, const char *text)
{
    static char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
    return path;
}

static json_t *load_ok(const char *name, const char *text)
{
    char why[300];
    json_t *doc = config_file_load(file_with(name, text), why, sizeof why);
    if (!doc)
        fail_msg("%s: %s", name, why);
    return doc;
}

/* The file is refused with a message containing want. */
static void load_refused(const char *name, const char *text, const char *want)
{
    char why[300];
    json_t *doc = config_file_load(file_with(name, text), why, sizeof why);
    if (doc) {
        json_decref(doc);
        fail_msg("%s was read; expected \"%s\"", name, want);
    }
    if (!strstr(why, want))
        fail_msg("%s: \"%s\" lacks \"%s\"", name, why, want);
}

static void test_yaml_equals_json(void **state)
{
    (void)state;
    json_t *from_json = load_ok("c.json",
                                "{\"stages\": 2, \"max_seqs\": 16, \"kv\": \"kivi2\", \"quiet\": true,\n"
                                " \"device_kv_mib\": 0.5, \"listen\": \"127.0.0.1:50051\", \"secret_file\": null,\n"
                                " \"stage_layers\": \"19,11\", \"port\": \"8080\", \"list\": [1, \"two\"],\n"
                                " \"nested\": {\"a\": -3}}");
    json_t *from_yaml = load_ok("c.yaml",
                                "# the same settings\n"
                                "stages: 2\n"
                                "max_seqs: 16\n"
                                "kv: kivi2\n"
                                "quiet: true\n"
                                "device_kv_mib: 0.5\n"
                                "listen: 127.0.0.1:50051\n"
                                "secret_file: ~\n"
                                "stage_layers: 19,11\n"
                                "port: \"8080\"   # quoted: text\n"
                                "list: [1, two]\n"
                                "nested:\n"
                                "  a: -3\n");
    if (!json_equal(from_json, from_yaml)) {
        char *a = json_dumps(from_json, JSON_SORT_KEYS), *b = json_dumps(from_yaml, JSON_SORT_KEYS);
        fail_msg("JSON %s\nYAML %s", a, b);
    }
    json_decref(from_json);
    json_decref(from_yaml);
    assert_true(config_file_is_yaml("x.yml") && config_file_is_yaml("/a/b.yaml"));
    assert_false(config_file_is_yaml("x.json") || config_file_is_yaml("yaml") || config_file_is_yaml(".yml.json"));
}

static void test_yaml_scalars(void **state)
{
    (void)state;
    json_t *d = load_ok("s.yml", "a: TRUE\nb: False\nc: 007\nd: +12\ne: 1e3\nf: .inf\ng: 99999999999999999999\n"
                                 "h: 'true'\ni:\nj: 0x1p3\nk: 1_000\nl: |\n  two\n  lines\n");
    assert_true(json_is_true(json_object_get(d, "a")));
    assert_true(json_is_false(json_object_get(d, "b")));
    assert_int_equal(json_integer_value(json_object_get(d, "c")), 7);
    assert_int_equal(json_integer_value(json_object_get(d, "d")), 12);
    assert_true(json_is_real(json_object_get(d, "e")) && json_real_value(json_object_get(d, "e")) == 1000.0);
    /* What is no finite number stays text, for the option's parser to refuse with its range. */
    assert_string_equal(json_string_value(json_object_get(d, "f")), ".inf");
    assert_string_equal(json_string_value(json_object_get(d, "g")), "99999999999999999999");
    assert_string_equal(json_string_value(json_object_get(d, "h")), "true");
    assert_true(json_is_null(json_object_get(d, "i")));
    assert_string_equal(json_string_value(json_object_get(d, "j")), "0x1p3");
    assert_string_equal(json_string_value(json_object_get(d, "k")), "1_000");
    assert_string_equal(json_string_value(json_object_get(d, "l")), "two\nlines\n");
    json_decref(d);
    /* Nothing but comments: no setting, not an error. */
    d = load_ok("empty.yaml", "# nothing set\n");
    assert_true(json_is_object(d) && json_object_size(d) == 0);
    json_decref(d);
}

static void test_refusals(void **state)
{
    (void)state;
    load_refused("syntax.yaml", "stages: [2\nkv: kivi2\n", "line 2: did not find expected ',' or ']'");
    load_refused("dup.yaml", "stages: 2\nkv: kivi2\nstages: 3\n", "line 3: duplicate key 'stages'");
    load_refused("listkey.yaml", "? [a, b]\n: 1\n", "line 1: a key must be a plain name");
    load_refused("two.yaml", "stages: 2\n---\nstages: 3\n", "line 3: a second YAML document");
    /* A double-quoted "\0" is a NUL inside the value: C strings would cut it there, silently. */
    load_refused("nul.yaml", "kv: kivi2\nnvme_dir: \"/tmp/a\\0b\"\n", "line 2: a value holds a NUL character");
    load_refused("nulkey.yaml", "kv: kivi2\n\"stages\\0x\": 2\n", "line 2: a key holds a NUL character");
    load_refused("dup.json", "{\"stages\": 2, \"stages\": 3}", "line 1: duplicate object key");
    load_refused("syntax.json", "{\"stages\": 2,\n \"kv\": }", "line 2: ");
}

static void test_refusals_of_size(void **state)
{
    (void)state;
    /* 70 levels of nested lists */
    char deep[256] = "a: ";
    for (int i = 0; i < 70; i++)
        strcat(deep, "[");
    for (int i = 0; i < 70; i++)
        strcat(deep, "]");
    strcat(deep, "\n");
    load_refused("deep.yaml", deep, "nested more than 64 deep");
    /* Each line's list names the previous one 10 times: 10^8 values once expanded. */
    char bomb[2048] = "a: &a [x, x, x, x, x, x, x, x, x, x]\n";
    for (char c = 'b'; c <= 'i'; c++) {
        char line[128];
        snprintf(line, sizeof line, "%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n", c, c, c - 1, c - 1,
                 c - 1, c - 1, c - 1, c - 1, c - 1, c - 1, c - 1, c - 1);
        strcat(bomb, line);
    }
    load_refused("bomb.yaml", bomb, "more than 100000 values");
}

static void test_files_that_are_not(void **state)
{
    (void)state;
    char why[300];
    assert_null(config_file_load(dir, why, sizeof why));
    assert_string_equal(why, "is a directory, not a config file");
    char path[128];
    snprintf(path, sizeof path, "%s/none.yaml", dir);
    assert_null(config_file_load(path, why, sizeof why));
    assert_non_null(strstr(why, "unable to open"));
    assert_non_null(strstr(why, "No such file or directory"));
    snprintf(path, sizeof path, "%s/none.json", dir);
    assert_null(config_file_load(path, why, sizeof why));
    assert_non_null(strstr(why, "unable to open"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_yaml_equals_json),
        cmocka_unit_test(test_yaml_scalars),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_refusals_of_size),
        cmocka_unit_test(test_files_that_are_not),
    };
    return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
