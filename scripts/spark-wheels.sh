# Sourced by scripts/install and scripts/test-lowest: --find-links options for the pyspark and
# pyspark-client wheels pip has built on this machine from their sdists (pip keeps built wheels in
# its cache; uv does not look there). With them, uv installs Spark without downloading and
# building 450 MB of sdists again; without them (a machine where pip never built one) uv builds
# them itself, once, into its own cache.
spark_wheel_links() {
  local python=$1 whl
  for whl in $("$python" -m pip cache list --format=abspath 'pyspark*' 2>/dev/null); do
    printf -- '--find-links\n%s\n' "$(dirname "$whl")"
  done
}
