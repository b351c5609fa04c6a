#!/usr/bin/env bash
# Demo accuracy with fp8 vs default KV (issue 35, point 3): bench.accuracy against
#   colocated plain, colocated EAGLE, 1P1D plain -> plain, 1P1D plain -> EAGLE (the seed's cell)
# (or the cells in $CELLS) for each --kv-cache-dtype in $KV_DTYPES, $QUESTIONS per task. Servers bind 127.0.0.1 on free ports; every
# process is started and stopped (by its pid) here. Results: $WORK/<kv>_<cell>.json and a
# markdown table on stdout.
#
#   bash scripts/bench_kv_fp8.sh [WORKDIR]
set -euo pipefail

PYTHON="${PYTHON:-python}"
WORK="${1:-$(mktemp -d /tmp/bench_kv_fp8.XXXXXX)}"
: "${KV_DTYPES:=auto fp8_e4m3 fp8_e5m2}"
: "${QUESTIONS:=64}"
: "${CELLS:=colocated colocated-eagle pd-plain pd-plain-to-eagle}"
: "${STARTUP_TIMEOUT:=300}"
mkdir -p "$WORK/logs"
EAGLE_DIR="$($PYTHON -c 'from pdserve import assets; print(assets.path("demo-eagle"))')"
SPEC=(--speculative-algorithm EAGLE --speculative-draft-model-path "$EAGLE_DIR" --speculative-num-steps 3
      --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
COMMON=(--max-total-tokens 65536 --page-size 16)
PIDS=()

free_port() { $PYTHON -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop_all() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    PIDS=()
}
trap stop_all EXIT

# start NAME CMD...: runs CMD in the background, logging to $WORK/logs/NAME.log.
start() { local name="$1"; shift; echo "\$ $*" >>"$WORK/commands.txt"; "$@" >"$WORK/logs/$name.log" 2>&1 & PIDS+=($!); }

wait_up() {
    local url="$1" name="$2" t=0
    until curl -sf -o /dev/null --max-time 5 "$url/health"; do
        sleep 1; t=$((t + 1))
        if [ "$t" -ge "$STARTUP_TIMEOUT" ]; then tail -n 30 "$WORK/logs/$name.log" >&2; return 1; fi
    done
}

accuracy() {  # accuracy URL OUT
    $PYTHON -m pdserve.bench.accuracy --base-url "$1" --num-questions "$QUESTIONS" --parallel 8 --task all \
        --output-file "$2" >/dev/null
}

for kv in $KV_DTYPES; do
    KV=(--kv-cache-dtype "$kv")
    for cell in $CELLS; do
        case "$cell" in
            colocated|colocated-eagle)
                port="$(free_port)"
                extra=(); [ "$cell" = colocated-eagle ] && extra=("${SPEC[@]}")
                start "${kv}_$cell" $PYTHON -m pdserve.launch_server --port "$port" "${COMMON[@]}" "${KV[@]}" "${extra[@]}"
                url="http://127.0.0.1:$port"
                wait_up "$url" "${kv}_$cell"
                ;;
            pd-*)
                pport="$(free_port)"; boot="$(free_port)"; dport="$(free_port)"; rport="$(free_port)"
                extra=(); [ "$cell" = pd-plain-to-eagle ] && extra=("${SPEC[@]}")
                start "${kv}_${cell}_p" $PYTHON -m pdserve.launch_server --port "$pport" --disaggregation-mode prefill \
                    --disaggregation-bootstrap-port "$boot" "${COMMON[@]}" "${KV[@]}"
                start "${kv}_${cell}_d" $PYTHON -m pdserve.launch_server --port "$dport" --disaggregation-mode decode \
                    "${COMMON[@]}" "${KV[@]}" "${extra[@]}"
                wait_up "http://127.0.0.1:$pport" "${kv}_${cell}_p"
                wait_up "http://127.0.0.1:$dport" "${kv}_${cell}_d"
                start "${kv}_${cell}_r" $PYTHON -m pdserve.router --pd-disaggregation \
                    --prefill "http://127.0.0.1:$pport" "$boot" --decode "http://127.0.0.1:$dport" --port "$rport"
                url="http://127.0.0.1:$rport"
                wait_up "$url" "${kv}_${cell}_r"
                ;;
        esac
        echo "\$ $PYTHON -m pdserve.bench.accuracy --base-url $url --num-questions $QUESTIONS --parallel 8 --task all" \
            >>"$WORK/commands.txt"
        accuracy "$url" "$WORK/${kv}_$cell.json"
        stop_all
    done
done

$PYTHON - "$WORK" "$CELLS" $KV_DTYPES <<'EOF'
import json, sys
from pathlib import Path
work, cells, kvs = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
def load(kv, cell):
    raw = json.loads((work / f"{kv}_{cell}.json").read_text())
    rows = raw if isinstance(raw, list) else raw.get("results", raw.get("tasks", []))
    return {r["task"]: r for r in rows}
tasks = list(load(kvs[0], cells[0]))
print("| --kv-cache-dtype | deployment | " + " | ".join(tasks) + " | max drop vs auto | failed requests |")
print("|---|---|" + "---|" * (len(tasks) + 2))
for kv in kvs:
    for cell in cells:
        got, base = load(kv, cell), load(kvs[0], cell)
        drop = max(base[t]["accuracy"] - got[t]["accuracy"] for t in tasks)
        print(f"| {kv} | {cell} | " + " | ".join(f"{got[t]['accuracy']:.3f}" for t in tasks)
              + f" | {drop:+.3f} | {sum(got[t]['errors'] for t in tasks)} |")
EOF
