#!/bin/bash
# Stand-in for `mrl engine` on an engine node (MRL_ENGINE_CMD): announce ENGINES_PER_NODE engines as
# $RUN_DIR/engines/<host>-engine<i>.url, as mrl engine does once healthy, and withdraw them on TERM.
# On a scoring pool's node (MRL_SCORING_CMD, MRL_POOL set by mrl_node.sh): its share of the pool's engines
# (SCORING_POOLS "pool:nodes:per_node"), as $RUN_DIR/engines/<pool>/<host>-<pool><i>.url.
host=${FAKE_HOST:-$(hostname -s)}
kind=engine dir=$RUN_DIR/engines count=${ENGINES_PER_NODE:-1} port=30000
if [[ -n ${MRL_POOL:-} ]]; then
  kind=$MRL_POOL dir=$RUN_DIR/engines/$MRL_POOL port=31000
  for entry in $SCORING_POOLS; do [[ ${entry%%:*} == "$MRL_POOL" ]] && count=${entry##*:}; done
  mkdir -p "$dir"
fi
names=()
for (( i = 0; i < count; i++ )); do
  names+=("$host-$kind$i")
  echo "http://$host:$(( port + i ))" > "$dir/$host-$kind$i.url"
done
echo "stand-in engine on $host: announced ${names[*]}"
stop() {
  for n in "${names[@]}"; do rm -f "$dir/$n.url"; done
  echo "stand-in engine on $host: TERM, withdrawn"
  exit 0
}
trap stop TERM
for _ in $(seq 600); do sleep 0.1; done
echo "stand-in engine on $host: never stopped" >&2
exit 3
