#!/usr/bin/env bash
# Creates the local virtual environment for the README's commands and installs what is missing.
#   bootstrap.sh PYTHON VENV
# - If PYTHON can already import torch (e.g. a CUDA build), the venv sees it through
#   --system-site-packages and it is used as is; otherwise torch==2.13.0 (CPU) is installed.
# - Only packages that do not import are installed, so a machine without network access that
#   already has them (the lent GPU box) needs no registry.
set -euo pipefail
PYTHON=${1:-python3}
VENV=${2:-.venv}
cd "$(dirname "$0")/.."

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "bootstrap: using the installed torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
    # --system-site-packages reaches the base interpreter's packages only: where PYTHON is itself a
    # virtual environment (as on many GPU images), its own site-packages are added by a .pth file
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() if p.startswith(sys.prefix)))' \
      > "$site/_bootstrap_parent_site.pth"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: installing torch==2.13.0 (CPU)"
  "$PY" -m pip install -q torch==2.13.0
fi

# requirement -> import name
missing=()
while read -r req; do
  req=${req%%#*}; req=$(echo "$req" | xargs)
  [ -z "$req" ] && continue
  name=${req%%[<>=]*}
  mod=$(echo "$name" | tr '-' '_')
  if [ "$mod" = "cmake" ] || [ "$mod" = "ninja" ]; then
    [ -x "$VENV/bin/$mod" ] || command -v "$mod" >/dev/null 2>&1 || missing+=("$req")
    continue
  fi
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("$req")
done < .ci/requirements.txt
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}"
  # DS_BUILD_OPS=0: DeepSpeed's C++ ops are JIT-built only if used; pyinfinity replaces its aio op.
  DS_BUILD_OPS=0 "$PY" -m pip install -q "${missing[@]}"
fi
