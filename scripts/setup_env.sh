# Sourced by run_train.sh and scripts/run_tests.sh: sets PYTHON to an interpreter that can
# import torchtitan_ablate and its dependencies, creating .venv on first use.
# EXTRAS=dev also installs the test tools.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_mods="torch, torchdata, tiktoken, sentencepiece, safetensors"
[ "${EXTRAS:-}" = "dev" ] && _mods="$_mods, pytest, xdist, transformers"

# The import check costs a torch import (~3 s a launch): .venv's python passes it once after each
# install, and a stamp newer than pyproject.toml stands for it after that (dev covers the base).
_venv_py="$_root/.venv/bin/python"
_stamps=("$_root/.venv/.usable-dev")
[ "${EXTRAS:-}" = "dev" ] || _stamps+=("$_root/.venv/.usable")
_usable() {
  if [ "$1" = "$_venv_py" ]; then
    for _s in "${_stamps[@]}"; do [ "$_s" -nt "$_root/pyproject.toml" ] && return 0; done
  fi
  PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}" "$1" -c "import $_mods" 2>/dev/null || return 1
  if [ "$1" = "$_venv_py" ]; then touch "${_stamps[-1]}" 2>/dev/null || true; fi
}

if [ -n "${PYTHON:-}" ] && _usable "$PYTHON"; then
  :
elif [ -n "${VIRTUAL_ENV:-}" ] && _usable "$VIRTUAL_ENV/bin/python" && [ -z "${FORCE_VENV:-}" ]; then
  PYTHON="$VIRTUAL_ENV/bin/python"  # the user's activated environment, used as it is
elif [ -x "$_root/.venv/bin/python" ] && _usable "$_root/.venv/bin/python"; then
  PYTHON="$_root/.venv/bin/python"
elif [ -z "${VIRTUAL_ENV:-}" ] && _usable python3 && [ -z "${FORCE_VENV:-}" ]; then
  # (with a venv activated, python3 is its python, which failed above: set up .venv instead)
  PYTHON=python3
else
  echo "setting up $_root/.venv (first run) ..." >&2
  [ -x "$_root/.venv/bin/python" ] || python3 -m venv "$_root/.venv"
  _pip="$_root/.venv/bin/python -m pip install -q"
  if ! "$_root/.venv/bin/python" -c "import torch" 2>/dev/null; then
    # Install torch first and pin it: resolving torchdata/torchao against an empty venv
    # would pull the newest CUDA build (several GB) even on a CPU-only machine.
    # TORCH_INDEX_URL: e.g. PyTorch's CPU index, where the default index serves a CUDA build.
    $_pip ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION:-2.13.0}" \
      || { echo "could not install torch" >&2; exit 1; }
  fi
  _constraints="$_root/.venv/torch-constraint.txt"
  # (stderr dropped: torch warns that numpy is not installed yet)
  "$_root/.venv/bin/python" -c "import torch; print('torch==' + torch.__version__)" \
    > "$_constraints" 2>/dev/null
  _spec="$_root"
  [ "${EXTRAS:-}" = "dev" ] && _spec="$_root[dev]"
  $_pip -c "$_constraints" -e "$_spec" || { echo "pip install failed" >&2; exit 1; }
  PYTHON="$_root/.venv/bin/python"
fi
export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
