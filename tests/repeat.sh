#!/usr/bin/env bash
# Run `make test` N times on this clone and say how each run ended: the flake rate of the suite.
#   bash tests/repeat.sh N [LOAD]     (make test-repeat N=5 LOAD=1)
# LOAD=1 keeps one CPU core busy with a separate process for the whole time. Each run's log: .test-repeat/runI.log.
set -u
n=${1:-5}
load=${2:-0}
pass=0
fail=0
mkdir -p .test-repeat
busy=""
if [ "$load" = 1 ]; then
  python3 -c "while True: pass" &
  busy=$!
  trap 'kill $busy 2>/dev/null' EXIT
fi
echo "make test x $n on $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, load: $([ -n "$busy" ] && echo 'one core kept busy' || echo none)"
for i in $(seq 1 "$n"); do
  log=".test-repeat/run$i.log"
  start=$(date +%s)
  if make --no-print-directory test >"$log" 2>&1; then
    verdict=green
    pass=$((pass + 1))
  else
    verdict=RED
    fail=$((fail + 1))
  fi
  tally=$(grep -E "^(=+ )?[0-9]+ (passed|failed).* in [0-9.]+s" "$log" | sed -E 's/=+//g; s/^ +| +$//g' | paste -sd'|' -)
  echo "run $i: $verdict in $(($(date +%s) - start)) s ($tally)"
  [ "$verdict" = RED ] && grep -E "^FAILED|^ERROR" "$log" | sed 's/^/    /'
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
