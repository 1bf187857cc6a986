#!/bin/bash
# Two hosts on one machine: two Linux network namespaces joined by a virtual cable (a veth
# pair), each with its own IP address and host name, and one torchrun agent in each. On
# the wire this is exactly a two-machine job: node 1 reaches node 0 at 10.77.0.1, and Gloo
# is told which interface to use. Needs root and iproute2.
#
#   sudo bash launch/netns_two_hosts.sh                                   # hello_distributed, 2 x 2 ranks
#   sudo NPROC_PER_NODE=1 bash launch/netns_two_hosts.sh primitives/all_reduce.py
#
# On two real machines the same two commands, run one on each, are:
#   host A (10.77.0.1): GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 \
#                         --master_addr=10.77.0.1 --master_port=29400 LESSON
#   host B:             GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 \
#                         --master_addr=10.77.0.1 --master_port=29400 LESSON
set -euo pipefail

lesson=${1:-primitives/hello_distributed.py}
[ $# -gt 0 ] && shift
[ -f "$lesson" ] || { echo "error: lesson file '$lesson' not found in $PWD" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "error: network namespaces need root: run with sudo" >&2; exit 2; }
command -v ip >/dev/null || { echo "error: 'ip' not found: install iproute2" >&2; exit 2; }

nproc=${NPROC_PER_NODE:-2}
port=${MASTER_PORT:-29400}
tag=$$                                   # unique names, so that runs never collide
ns=(tdA$tag tdB$tag) dev=(vA$tag vB$tag) ip4=(10.77.0.1 10.77.0.2)
out=$(mktemp -d)
cleanup() {
    for n in "${ns[@]}"; do ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true; done
    for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
    rm -rf "$out"
}
trap cleanup EXIT

ip link add "${dev[0]}" type veth peer name "${dev[1]}"
for i in 0 1; do
    ip netns add "${ns[$i]}"
    ip link set "${dev[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "${ip4[$i]}/24" dev "${dev[$i]}"
    ip -n "${ns[$i]}" link set "${dev[$i]}" up
    ip -n "${ns[$i]}" link set lo up
done
echo "host node0: ${ip4[0]} on ${dev[0]} | host node1: ${ip4[1]} on ${dev[1]} | ${nproc} rank(s) each"

pids=()
for i in 0 1; do
    # unshare --uts gives each "host" its own host name; GLOO_SOCKET_IFNAME picks the cable.
    ip netns exec "${ns[$i]}" unshare --uts sh -c 'hostname "$0"; exec "$@"' "node$i" \
        env GLOO_SOCKET_IFNAME="${dev[$i]}" NCCL_SOCKET_IFNAME="${dev[$i]}" \
        torchrun --nnodes=2 --node_rank="$i" --nproc_per_node="$nproc" \
        --master_addr="${ip4[0]}" --master_port="$port" "$lesson" "$@" > "$out/node$i.log" 2>&1 &
    pids+=($!)
done
status=0
for i in 0 1; do wait "${pids[$i]}" || status=$?; done
for i in 0 1; do
    # grep -v exits 1 when it keeps no line (a node that printed only torchrun's notices): not a failure.
    sed "s/^/[node$i] /" "$out/node$i.log" | grep -v "Setting OMP_NUM_THREADS\|\*\*\*\*\*\|run.py:[0-9]*\] *$" || true
done
exit $status
