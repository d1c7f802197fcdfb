#!/usr/bin/env bash
# vegaserve and llama-server on the same file, one after the other, timed by the same client
# (benchmarks/bench_serving.py): each server started fresh, warmed with one wave of requests, then timed.
#
#     benchmarks/serve_pair.sh FILE LLAMA_SERVER [CLIENTS] [REQUESTS] [OUT_DIR]
#
# The warm-up wave draws its prompts from another seed than the timed requests, so that neither server serves
# a timed prompt from its prompt cache. Defaults: 64 clients, 256 timed requests, 128-token prompts and
# outputs; llama-server with -ngl 99 -fa on -np CLIENTS -c 320 x CLIENTS (320 tokens a slot, more than a
# request needs). Each server's JSON report goes
# to OUT_DIR/served_{vegaserve,llama}.json (default: the current folder); its log to OUT_DIR/*.log.
set -uo pipefail
file=$1 llama=$2 clients=${3:-64} requests=${4:-256} out=${5:-.}
here=$(cd "$(dirname "$0")" && pwd)
client=(python3 "$here/bench_serving.py" --concurrency "$clients" --prompt-len 128 --output-len 128 --timeout 300)

up() {  # port, seconds: whether /health answered in time
  for _ in $(seq 1 "$2"); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 1; done
  return 1
}

run() {  # name, port, command...
  local name=$1 port=$2 t0=$SECONDS
  shift 2
  "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  if up "$port" 600; then
    echo "$name: ready after $((SECONDS - t0)) s"
    # the warm-up wave's prompts are its own (another seed): the timed requests hit no server's prompt cache
    "${client[@]}" --base-url "http://localhost:$port" --num-requests "$clients" --seed 1 >"$out/${name}_warm.txt" 2>&1
    echo "$name, warm-up wave: $(tail -1 "$out/${name}_warm.txt")"
    "${client[@]}" --base-url "http://localhost:$port" --num-requests "$requests" --json-out "$out/served_$name.json"
  else
    echo "$name: not up after 600 s; the end of its log:"
    tail -20 "$out/$name.log"
  fi
  kill "$pid"
  wait "$pid" 2>/dev/null
}

run vegaserve 8081 python3 -m vegaserve.server.cli serve -m "$file" -np "$clients" --port 8081
run llama 8082 "$llama" -m "$file" -ngl 99 -fa on -np "$clients" -c $((320 * clients)) --port 8082
