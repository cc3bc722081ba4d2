# Source it (`source scripts/device_setup.sh`) on a GPU machine without internet access, from the
# repository root: installs the wheels placed in .whl/ (e.g. torchdata, torchao; git-ignored)
# into /tmp/site, puts them and this checkout on PYTHONPATH, and sets PYTHON=python3.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHON=python3 PYTHONUNBUFFERED=1
