# Source after scripts/device/setup.sh on the lent GPU machine, with ".whl-ray" in carry (built
# here by `bash scripts/device/build-carry.sh ray`; .whl/ brings ray's jsonschema):
#   . scripts/device/setup.sh && . scripts/device/setup-ray.sh
# It unpacks ray 2.60 (a pruned cp312 wheel, see build-carry.sh) into /tmp/raysite once per
# machine and puts it first on PYTHONPATH, which Ray's workers inherit. `ray` has no console
# script there: use `python3 -m ray.scripts.scripts start|status|stop`.
# The machine has no network (Ray binds 127.0.0.1 by itself) and its memory grows as it is used
# (MemTotal reads low at first), so Ray's memory monitor, which kills workers above 95% of what
# it reads, is turned off.
if [ ! -f /tmp/raysite/.kvlab-ready ]; then
  if [ ! -f .whl-ray/ray-site.tar.xz ]; then
    echo "setup-ray.sh: no .whl-ray/ray-site.tar.xz carried: run \`bash scripts/device/build-carry.sh ray\` on your machine, then carry \".whl-ray\" too" >&2
    return 1
  fi
  rm -rf /tmp/raysite && mkdir -p /tmp/raysite && tar xJf .whl-ray/ray-site.tar.xz -C /tmp/raysite || return 1
  touch /tmp/raysite/.kvlab-ready
fi
export PYTHONPATH=/tmp/raysite${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 RAY_memory_monitor_refresh_ms=0
# fresh_dir DIR: the Ray device scripts' output folder, an earlier run's moved aside to DIR.N
# (a rerun on a warm machine starts afresh and loses nothing)
fresh_dir() {
  if [ -e "$1" ]; then
    local n=1; while [ -e "$1.$n" ]; do n=$((n + 1)); done; mv "$1" "$1.$n"
  fi
  mkdir -p "$1"
}
