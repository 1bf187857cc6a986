#!/bin/bash
# Two "nodes" on one machine: two torchrun agents, each starting NPROC_PER_NODE ranks, that
# meet as a 2-node job over 127.0.0.1. The same commands, with a real address, run a job
# on two machines (launch/README.md has them side by side).
#
#   bash launch/multinode_local.sh static launch/print_env.py          # --master_addr/--master_port
#   bash launch/multinode_local.sh c10d primitives/all_reduce.py       # --rdzv_backend=c10d
#   NPROC_PER_NODE=1 bash launch/multinode_local.sh c10d transformer_basics/train.py --steps 20
set -euo pipefail

mode=${1:-}
lesson=${2:-}
if [ "$mode" != static ] && [ "$mode" != c10d ]; then
    echo "error: usage: bash launch/multinode_local.sh static|c10d LESSON.py [ARGS...]" >&2; exit 2
fi
[ -f "$lesson" ] || { echo "error: lesson file '$lesson' not found in $PWD" >&2; exit 2; }
shift 2
nproc=${NPROC_PER_NODE:-2}
port=${MASTER_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

if [ "$mode" = static ]; then
    # Node 0's agent serves the store at master_addr:master_port; node_rank fixes each node's ranks.
    node_args() { echo --nnodes=2 --node_rank="$1" --master_addr=127.0.0.1 --master_port="$port"; }
else
    # c10d rendezvous: the agents agree on node ranks themselves; all that is shared is the
    # endpoint and a job id. (The first agent to arrive hosts the store.)
    node_args() { echo --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:"$port" --rdzv_id=local-"$port"; }
fi

echo "2 nodes x $nproc rank(s), $mode rendezvous on 127.0.0.1:$port"
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT
pids=()
for node in 0 1; do
    # shellcheck disable=SC2046
    torchrun $(node_args $node) --nproc_per_node="$nproc" "$lesson" "$@" > "$out/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for node in 0 1; do wait "${pids[$node]}" || status=$?; done
for node in 0 1; do
    sed "s/^/[node$node] /" "$out/node$node.log" | grep -v "Setting OMP_NUM_THREADS\|\*\*\*\*\*\|run.py:[0-9]*\] *$" || true
done
exit $status
