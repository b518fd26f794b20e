#!/bin/bash
# Stand-in for `mrl engine` on an engine node (MRL_ENGINE_CMD): announce ENGINES_PER_NODE engines as
# $RUN_DIR/engines/<host>-engine<i>.url, as mrl engine does once healthy, and withdraw them on TERM.
host=${FAKE_HOST:-$(hostname -s)}
names=()
for (( i = 0; i < ${ENGINES_PER_NODE:-1}; i++ )); do
  names+=("$host-engine$i")
  echo "http://$host:$(( 30000 + i ))" > "$RUN_DIR/engines/$host-engine$i.url"
done
echo "stand-in engine on $host: announced ${names[*]}"
stop() {
  for n in "${names[@]}"; do rm -f "$RUN_DIR/engines/$n.url"; done
  echo "stand-in engine on $host: TERM, withdrawn"
  exit 0
}
trap stop TERM
for _ in $(seq 600); do sleep 0.1; done
echo "stand-in engine on $host: never stopped" >&2
exit 3
