#!/usr/bin/env bash
# A GPU run longer than one device call: start it detached, then collect it in later calls on the same machine.
#
#   benchmarks/detach.sh start NAME COMMAND [ARGS...]   run COMMAND in its own session (setsid, nohup) with OUT set to
#                                                      /tmp/oomb-detached/NAME/out; its output goes to .../NAME/log
#   benchmarks/detach.sh collect NAME [WAIT_S]          wait up to WAIT_S seconds (default 540) for it to end, returning
#                                                      as soon as it does; then pack .../NAME into $OUT/NAME.tgz (one
#                                                      file, whatever the run wrote) and print the log's tail
#
# collect exits 3 at once when /tmp/oomb-detached/NAME does not exist: the machine that ran `start` was given back and
# this call got a fresh one, so waiting would only spend device time. It exits 0 when the run has ended (its exit
# status is in .../NAME/rc and printed), 4 when it is still running after WAIT_S (call collect again).
#
# Example, one call each (the next call must follow within the machine's warm period):
#   benchmarks/detach.sh start ff benchmarks/run_gpu.sh finetune --budget-s 1500 --only 262144:dense:adamw-bf16
#   benchmarks/detach.sh collect ff 560
set -uo pipefail
cd "$(dirname "$0")/.."
verb=${1:?usage: benchmarks/detach.sh start NAME COMMAND... | collect NAME [WAIT_S]}
name=${2:?a NAME for the run}
dir=/tmp/oomb-detached/$name
case "$verb" in
  start)
    shift 2
    [ $# -gt 0 ] || { echo "detach.sh start $name: give the COMMAND to run" >&2; exit 2; }
    [ -e "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null && { echo "detach.sh: $name is running already" >&2; exit 2; }
    rm -rf "$dir"; mkdir -p "$dir/out"
    OUT="$dir/out" setsid nohup bash -c '"$@"; echo $? > "$0/rc"' "$dir" "$@" > "$dir/log" 2>&1 < /dev/null &
    echo $! > "$dir/pid"
    echo "started $name (pid $(cat "$dir/pid")): $*"
    ;;
  collect)
    wait_s=${3:-540}
    [ -d "$dir" ] || { echo "detach.sh: no $dir: this is a fresh machine, the run is lost; start it again" >&2; exit 3; }
    t0=$(date +%s)
    while [ ! -e "$dir/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do sleep 2; done
    tar czf "${OUT:-.}/$name.tgz" -C /tmp/oomb-detached "$name"
    tail -n 30 "$dir/log"
    if [ -e "$dir/rc" ]; then echo "detach.sh: $name ended, exit status $(cat "$dir/rc")"; exit 0; fi
    echo "detach.sh: $name still running after ${wait_s} s; collect again" >&2; exit 4
    ;;
  *) echo "detach.sh: unknown verb '$verb' (start, collect)" >&2; exit 2 ;;
esac
