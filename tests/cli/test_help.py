"""Every program's --help is true to its parser: each option --help lists is accepted, and each
option in the program's getopt table is either named by --help or refused by the program. And
the README's option tables name only options some program's --help lists.

usage: test_help.py BUILD_DIR SOURCE_DIR

The options a program accepts are read from its source: the getopt_long tables of the files
below, with the option macros of coordinator/cli/*.h expanded. An option is tried by giving it
(with the argument 1 when it takes one) before --help: a parser that knows it goes on to --help
and exits 0, or refuses the value with its own message; one that does not know it says
"unrecognized option" or "is not an option of this command". Nothing is loaded or started:
--help ends every run.
"""
import glob
import os
import re
import subprocess
import sys

BUILD, SOURCE = sys.argv[1], sys.argv[2]
STRATA = os.path.join(BUILD, "strata")
PROGRAMS = [  # (argv before the options, source files of its option table)
    ([STRATA, "generate"], ["coordinator/cli/generate.c"]),
    ([STRATA, "eval"], ["coordinator/cli/eval.c"]),
    ([STRATA, "calibrate"], ["coordinator/cli/calibrate.c"]),
    ([STRATA, "inspect"], ["coordinator/cli/inspect.c"]),
    ([STRATA, "drain"], ["coordinator/cli/drain.c"]),
    ([STRATA, "serve"], ["coordinator/service/serve.c"]),
    ([os.path.join(BUILD, "strata-coordinator")], ["coordinator/service/serve.c"]),
    ([os.path.join(BUILD, "strata-worker")], ["worker/cmd/worker_main.c"]),
]
ENTRY = re.compile(r"^\s{1,8}(?:-[A-Za-z0-9], )?--([a-z0-9-]+)( \S)?", re.M)
OPTION = re.compile(r'\{"([a-z0-9-]+)",\s*(no_argument|required_argument|optional_argument)')
UNKNOWN = re.compile(r"unrecognized option|is not an option of this command|invalid option")


def read(path):
    with open(os.path.join(SOURCE, path), encoding="utf-8") as f:
        return f.read()


def option_macros():
    """NAME -> the option entries of a '#define NAME' in coordinator/cli/*.h."""
    macros = {}
    for header in glob.glob(os.path.join(SOURCE, "coordinator/cli/*.h")):
        text = open(header, encoding="utf-8").read()
        for m in re.finditer(r"#define (\w+)((?:[^\n]*\\\n)+[^\n]*)", text):
            entries = OPTION.findall(m.group(2))
            if entries:
                macros[m.group(1)] = entries
    return macros


def table(sources, macros):
    """{long option: takes an argument} of the sources' option tables."""
    opts = {}
    for src in sources:
        text = read(src)
        for name, kind in OPTION.findall(text):
            opts[name] = kind != "no_argument"
        for macro, entries in macros.items():
            if re.search(r"\b%s\b" % macro, text):
                for name, kind in entries:
                    opts[name] = kind != "no_argument"
    return opts


SANITIZER_REPORTS = []


def run(argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if "Sanitizer" in p.stderr:   # a parser that leaks or overruns on the way to --help
        SANITIZER_REPORTS.append(f"{' '.join(argv)}:\n{p.stderr[-3000:]}")
    return p.returncode, p.stdout, p.stderr


def main():
    macros = option_macros()
    problems = []
    everywhere = {}   # every option some program's --help lists
    for argv, sources in PROGRAMS:
        name = " ".join(os.path.basename(a) for a in argv)
        code, out, err = run(argv + ["--help"])
        if code != 0 or not out.startswith("usage:") or err:
            problems.append(f"{name} --help: exit {code}, stdout {out[:60]!r}, stderr {err[:200]!r}")
            continue
        code_h, out_h, _ = run(argv + ["-h"])
        if code_h != 0 or out_h != out:
            problems.append(f"{name} -h: exit {code_h}, not the text of --help")
        listed = {m.group(1): bool(m.group(2)) for m in ENTRY.finditer(out)}
        everywhere.update(listed)
        accepted = table(sources, macros)
        if not accepted:
            problems.append(f"{name}: no option table found in {sources}")
            continue
        for opt, takes_arg in sorted(listed.items()):
            given = [f"--{opt}"] + (["1"] if takes_arg else [])
            code, _, err = run(argv + given + ["--help"])
            if UNKNOWN.search(err) or opt not in accepted:
                problems.append(f"{name}: --help lists --{opt}, which the parser refuses: {err.strip()[:200]}")
            elif takes_arg != accepted[opt]:
                problems.append(f"{name}: --help shows --{opt} {'with' if takes_arg else 'without'} an argument, "
                                "the parser the other way")
        for opt, takes_arg in sorted(accepted.items()):
            if re.search(r"--%s(?![a-z0-9-])" % re.escape(opt), out):   # not --kv for --kv-codecs
                continue
            given = [f"--{opt}"] + (["1"] if takes_arg else [])
            code, _, err = run(argv + given + ["--help"])
            if not UNKNOWN.search(err):
                problems.append(f"{name}: --{opt} is accepted but --help does not name it (exit {code})")
        print(f"{name}: {len(listed)} options listed, {len(accepted)} in its table: checked")
    # The README's option tables (first column) name only options some program lists.
    named = set()
    for line in read("README.md").splitlines():
        if line.startswith("| `-"):
            named |= set(re.findall(r"--([a-z0-9-]+)", line.split("|")[1]))
    for opt in sorted(named - set(everywhere)):
        problems.append(f"README.md's option tables name --{opt}, which no program's --help lists")
    print(f"README.md: {len(named)} options in its tables: checked")
    problems += SANITIZER_REPORTS
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print("every --help is true to its parser")


if __name__ == "__main__":
    main()
