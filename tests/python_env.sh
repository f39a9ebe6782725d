# Sourced by the test scripts that drive strata from Python: py is /usr/bin/python3 (the python3
# first on PATH may be a pyenv without the Debian modules); each require_* exits 77 (ctest:
# skipped) with a SKIP line when something is missing.
py=/usr/bin/python3

# require_python MODULE...: python3 imports every module.
require_python() {
  local mods
  mods=$(IFS=,; echo "$*")
  if [[ ! -x $py ]] || ! "$py" -c "import $mods" 2>/dev/null; then
    echo "SKIP: $py cannot import $mods"
    exit 77
  fi
}

# require_tools TOOL...: every tool is on PATH.
require_tools() {
  local tool
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null; then
      echo "SKIP: $tool is not installed"
      exit 77
    fi
  done
}
