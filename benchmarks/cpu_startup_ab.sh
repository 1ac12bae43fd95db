#!/usr/bin/env bash
# CPU start of models (GGUF files or checkpoint directories) with two binaries, alternating run by
# run on one machine (page cache warm): process start -> /health -> first token of a 16-token
# completion, the peak RSS of loading and generating one token, and the greedy tokens of both
# binaries compared. RSERVE_ARGS (split on spaces) go to both, e.g. RSERVE_ARGS="--isq q4k".
#   benchmarks/cpu_startup_ab.sh BEFORE AFTER RUNS MODEL...   results: $OUT/cpu_startup_ab.jsonl
set -uo pipefail
OUT=${OUT:-/tmp/rserve-cpu-ab}
mkdir -p "$OUT"
before=$1 after=$2 runs=$3
shift 3
read -r -a args <<<"${RSERVE_ARGS:-}"
tag="$(echo "${RSERVE_ARGS:-}" | tr -d ' ')"
for m in "$@"; do
  for i in $(seq "$runs"); do
    for b in "$before" "$after"; do
      "$b" bench startup "$m" --binary "$b" --runs 1 --json -- "${args[@]}" | grep '^{' |
        sed "s|^{|{\"binary\": \"$b\", \"model\": \"$(basename "$m")$tag\", |" >>"$OUT/cpu_startup_ab.jsonl"
    done
  done
  for b in "$before" "$after"; do
    /usr/bin/time -f "%M" -o "$OUT/rss" "$b" generate "$m" "${args[@]}" --prompt "t5 t6 t7 t8" \
      --max-tokens 24 --temperature 0 >"$OUT/greedy-$(basename "$b")-$(basename "$m")$tag.txt" 2>/dev/null
    echo "{\"binary\": \"$b\", \"model\": \"$(basename "$m")$tag\", \"peak_rss_kb\": $(tail -1 "$OUT/rss")}" >>"$OUT/cpu_startup_ab.jsonl"
  done
  cmp -s "$OUT/greedy-$(basename "$before")-$(basename "$m")$tag.txt" "$OUT/greedy-$(basename "$after")-$(basename "$m")$tag.txt" &&
    echo "$(basename "$m")$tag: greedy text identical" || echo "$(basename "$m")$tag: greedy text DIFFERS"
done
python3 - "$OUT/cpu_startup_ab.jsonl" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
ft, rss = collections.defaultdict(list), {}
for r in rows:
    key = (r["model"], r["binary"])
    if "first_token_s" in r:
        ft[key].append(r["first_token_s"])
    if "peak_rss_kb" in r:
        rss[key] = r["peak_rss_kb"] / 1024
for key, v in ft.items():
    print(f"{key[0]:32s} {key[1]:28s} first token {min(v):.2f}-{max(v):.2f} s (median {sorted(v)[len(v)//2]:.2f}), peak RSS {rss.get(key, 0):.0f} MiB")
PY
