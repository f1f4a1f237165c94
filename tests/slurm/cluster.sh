#!/usr/bin/env bash
# A real multi-node Slurm (Debian 12's slurm 22.05) on this one machine, for the tests of
# `elasticrl launch --scheduler slurm` (tests/integration/test_launch.py starts and stops it).
# Adapted from the project's shared recipe (shared/tools/local-slurm.sh, whose notes explain
# each choice); defaults changed for elasticrl: 8 nodes of 8 logical CPUs (the tiny PPO job's head
# and five app roles each take a node, and two join it), state under /tmp/elasticrl-slurm, and Slurm's
# default KillWait of 30 s, so that a cancelled step has time to stop the Ray it started.
#
#   cluster.sh start|stop|status|check|env|reset [DIR]
#
# Why several nodes: TorchX submits one het-job component per replica and Slurm starts het
# jobs only from backfill, which reserves whole nodes. Why accounting: TorchX's status and
# log paths call sacct. Node names n1..nN are mapped to 127.0.0.1 in /etc/hosts while the
# cluster runs (TorchX hands the head's node name to the others), and unmapped on stop.
set -euo pipefail

CMD=${1:-start}
DIR=${2:-${LOCAL_SLURM_DIR:-/tmp/elasticrl-slurm}}
DIR=$(realpath -m "$DIR")
NODES=${LOCAL_SLURM_NODES:-8}
export LOCAL_SLURM_CPUS_PER_NODE=${LOCAL_SLURM_CPUS_PER_NODE:-8}
ACCOUNTING=${LOCAL_SLURM_ACCOUNTING:-1}
FAKE_GPUS=${LOCAL_SLURM_FAKE_GPUS:-0}
PARTITION=${LOCAL_SLURM_PARTITION:-debug}
DEFAULT_TIME=${LOCAL_SLURM_DEFAULT_TIME:-60}
CLUSTER=${LOCAL_SLURM_CLUSTER:-elasticrl}
CTLD_PORT=${LOCAL_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${LOCAL_SLURM_SLURMD_PORT:-6821}
DBD_PORT=${LOCAL_SLURM_DBD_PORT:-6819}
DB_PORT=${LOCAL_SLURM_DB_PORT:-3316}
NICE=${LOCAL_SLURM_NICE:-10}
ETC_LINK=${LOCAL_SLURM_ETC_LINK:-1}
HOSTS_ENTRIES=${LOCAL_SLURM_HOSTS_ENTRIES:-1}
TIMEOUT=${LOCAL_SLURM_START_TIMEOUT:-90}

CONF=$DIR/etc/slurm.conf
RUN=$DIR/run
MUNGE_SOCK=$DIR/munge-run/munge.socket.2
DB_SOCK=$DIR/mysql/mysqld.sock
HOSTS_MARK="# elasticrl-slurm:$DIR"
NODE_NAMES=$(for i in $(seq 1 "$NODES"); do printf 'n%d ' "$i"; done)
export SLURM_CONF=$CONF

log() { printf '[elasticrl-slurm %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# --- pid bookkeeping: only ever signal a PID read from our own pid files, and only
# --- if /proc/PID/comm still names the daemon we started.
pid_alive() { # pidfile comm
  local f=$1 comm=$2 p
  [ -s "$f" ] || return 1
  p=$(cat "$f" 2>/dev/null) || return 1
  [[ $p =~ ^[0-9]+$ ]] || return 1
  [ "$(cat /proc/"$p"/comm 2>/dev/null)" = "$comm" ]
}
pid_gone() { # pid: exited (or a zombie waiting to be reaped)
  [ ! -e /proc/"$1" ] || [ "$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null || echo Z)" = Z ]
}
stop_pidfile() { # pidfile comm
  local f=$1 comm=$2 p i
  if pid_alive "$f" "$comm"; then
    p=$(cat "$f")
    kill -TERM "$p" 2>/dev/null || true
    for i in $(seq 1 60); do pid_gone "$p" && break; sleep 0.25; done
    if ! pid_gone "$p"; then log "$comm ($p) ignored TERM; KILL"; kill -KILL "$p" 2>/dev/null || true; sleep 0.5; fi
    log "stopped $comm ($p)"
  fi
  rm -f "$f"
}
wait_for() { # description, command...
  local what=$1 i; shift
  for i in $(seq 1 $((TIMEOUT * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  sinfo -R 2>/dev/null >&2 || true
  die "timed out after ${TIMEOUT}s waiting for $what (logs: $DIR/log)"
}

# --- install
install_if_missing() {
  local need=() pkgs
  command -v munged >/dev/null || need+=(munge)
  command -v slurmctld >/dev/null || need+=(slurmctld)
  command -v slurmd >/dev/null || need+=(slurmd)
  command -v sbatch >/dev/null || need+=(slurm-client)
  if [ "$ACCOUNTING" = 1 ]; then
    command -v slurmdbd >/dev/null || need+=(slurmdbd)
    command -v mariadbd >/dev/null || need+=(mariadb-server)
  fi
  [ ${#need[@]} -eq 0 ] && return 0
  pkgs="${need[*]}"
  log "installing: $pkgs"
  # no systemd here: make sure no postinst starts a system-wide munged/mariadb
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  if ! apt-get install -y -q --no-install-recommends $pkgs >"$DIR/log/apt.log" 2>&1; then
    apt-get update -q >>"$DIR/log/apt.log" 2>&1 || true
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $pkgs >>"$DIR/log/apt.log" 2>&1 \
      || { [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d; die "apt-get install failed, see $DIR/log/apt.log"; }
  fi
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

# --- config
write_configs() {
  local host mem cpus hw sockets cores threads overrides="" gres_line="" node_gres="" i
  host=$(hostname -s)
  hw=$(slurmd -C 2>/dev/null | head -1)
  sockets=$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$hw")
  cores=$(sed -n 's/.*CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$hw")
  threads=$(sed -n 's/.*ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$hw")
  cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw"); cpus=${cpus:-$(nproc)}
  local topo="Sockets=${sockets:-1} CoresPerSocket=${cores:-$cpus} ThreadsPerCore=${threads:-1}"
  if [ -n "${LOCAL_SLURM_CPUS_PER_NODE:-}" ] && [ "$LOCAL_SLURM_CPUS_PER_NODE" != "$cpus" ]; then
    cpus=$LOCAL_SLURM_CPUS_PER_NODE; topo="Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1"
    overrides="SlurmdParameters=config_overrides"
  fi
  # every node shares this machine's memory; memory is not a consumable resource
  # (CR_Core) so this only bounds what a job may ask with --mem
  mem=$(awk '/^MemTotal:/{m=int($2/1024); print m - (m/8 > 1024 ? int(m/8) : 1024)}' /proc/meminfo)
  if [ "$FAKE_GPUS" -gt 0 ]; then
    # slurm 22.05 drops a gpu GRES without File= ("Removing file-less GPU"), and the
    # node then drains ("gres/gpu count reported lower than configured"): give each
    # fake GPU a device file, a character device like /dev/null (a regular file works
    # too, with an error in slurmd's log)
    gres_line="GresTypes=gpu"; node_gres="Gres=gpu:$FAKE_GPUS"
    mkdir -p "$DIR/dev"
    for i in $(seq 0 $((FAKE_GPUS - 1))); do
      [ -e "$DIR/dev/gpu$i" ] || mknod "$DIR/dev/gpu$i" c 1 3 2>/dev/null || touch "$DIR/dev/gpu$i"
    done
    printf 'NodeName=n[1-%d] Name=gpu File=%s/dev/gpu[0-%d]\n' "$NODES" "$DIR" $((FAKE_GPUS - 1)) > "$DIR/etc/gres.conf"
  else
    rm -f "$DIR/etc/gres.conf"
  fi
  local acct="AccountingStorageType=accounting_storage/none"
  if [ "$ACCOUNTING" = 1 ]; then
    acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# the munge socket the clients (sacct, sacctmgr, slurmctld) use to reach slurmdbd
AccountingStoragePass=$MUNGE_SOCK"
  fi
  cat > "$CONF.new" <<EOF
# written by elasticrl tests/slurm/cluster.sh; DIR=$DIR
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long Slurm holds a requeued job before it may start again
# (default 120 s): 12 s keeps the tests' restart-on-requeue runs short
AuthInfo=socket=$MUNGE_SOCK,cred_expire=12
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$acct
JobCompType=jobcomp/none
MailProg=/bin/true
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# het jobs are only started by backfill: run it often
SchedulerParameters=bf_interval=2,bf_hetjob_immediate
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=30
Waittime=0
$gres_line
$overrides
NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$SLURMD_PORT-$((SLURMD_PORT + NODES - 1))] CPUs=$cpus $topo RealMemory=$mem $node_gres State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES DefaultTime=$DEFAULT_TIME MaxTime=INFINITE State=UP
EOF
  mv "$CONF.new" "$CONF"
  if [ "$ACCOUNTING" = 1 ]; then
    # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF
    cat > "$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm-local
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/etc/slurmdbd.conf"
  fi
}

# --- daemons
start_munge() {
  pid_alive "$DIR/munge-run/munged.pid" munged && return 0
  mkdir -p "$DIR/munge" "$DIR/munge-run"
  # key dir private; socket dir must be world-executable ("Socket is inaccessible")
  chown munge:munge "$DIR/munge" "$DIR/munge-run"; chmod 700 "$DIR/munge"; chmod 755 "$DIR/munge-run"
  [ -s "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key" --bits=1024
  # (re)own: a reinstalled munge package may come with another uid
  chown munge:munge "$DIR/munge/munge.key"; chmod 600 "$DIR/munge/munge.key"
  (cd / && nice -n "$NICE" runuser -u munge -- munged --socket="$MUNGE_SOCK" \
     --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge-run/munged.pid" \
     --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed")
  wait_for munged munge -n -S "$MUNGE_SOCK"
  log "munged up (pid $(cat "$DIR/munge-run/munged.pid"))"
}

start_db() {
  pid_alive "$DIR/mysql/mariadbd.pid" mariadbd && return 0
  mkdir -p "$DIR/mysql"; chown -R mysql:mysql "$DIR/mysql"
  if [ ! -d "$DIR/mysql/data/mysql" ]; then
    mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/mysql/data" \
      --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 \
      || die "mariadb-install-db failed, see $DIR/log/mariadb-install.log"
  fi
  # mariadbd does not daemonize: exec it (no shell left waiting on it) in its own
  # session, with no inherited stdout/stderr (a CI step would otherwise wait on it)
  (cd / && exec setsid nice -n "$NICE" mariadbd --no-defaults --user=mysql --datadir="$DIR/mysql/data" \
     --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
     --pid-file="$DIR/mysql/mariadbd.pid" --log-error="$DIR/mysql/mariadbd.err" \
     --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1) &
  wait_for mariadbd mariadb-admin --no-defaults -S "$DB_SOCK" -uroot ping
  mariadb --no-defaults -S "$DB_SOCK" -uroot -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm-local';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm-local';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  log "mariadbd up (pid $(cat "$DIR/mysql/mariadbd.pid"), port $DB_PORT)"
}

start_dbd() {
  if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd; then
    (cd / && nice -n "$NICE" slurmdbd)
  fi
  wait_for slurmdbd sacctmgr -n show cluster
  sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
  sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || die "cluster $CLUSTER not in slurmdbd"
  log "slurmdbd up (pid $(cat "$RUN/slurmdbd.pid"), port $DBD_PORT)"
}

start_slurm() {
  if ! pid_alive "$RUN/slurmctld.pid" slurmctld; then
    (cd / && nice -n "$NICE" slurmctld -f "$CONF")
  fi
  wait_for slurmctld scontrol ping
  local n
  for n in $NODE_NAMES; do
    pid_alive "$RUN/slurmd-$n.pid" slurmd && continue
    mkdir -p "$DIR/spool/d-$n"
    (cd / && nice -n "$NICE" slurmd -f "$CONF" -N "$n")
  done
  # all nodes idle (or mixed/allocated if jobs were already running)
  wait_for "nodes idle" bash -c "[ \"\$(sinfo -h -N -o '%T' | grep -cvE '^(idle|mixed|allocated)\$')\" = 0 ] && [ \"\$(sinfo -h -N -o '%N' | wc -l)\" = $NODES ]"
  log "slurmctld (pid $(cat "$RUN/slurmctld.pid")) and $NODES slurmd up; nodes: $(sinfo -h -N -o '%N:%T' | tr '\n' ' ')"
}

hosts_add() {
  [ "$HOSTS_ENTRIES" = 1 ] || return 0
  local missing=0 n
  for n in $NODE_NAMES; do getent hosts "$n" >/dev/null || missing=1; done
  [ $missing = 1 ] || return 0
  grep -v -F "$HOSTS_MARK" /etc/hosts > "$DIR/hosts.tmp" || true
  printf '127.0.0.1 %s %s\n' "$NODE_NAMES" "$HOSTS_MARK" >> "$DIR/hosts.tmp"
  cat "$DIR/hosts.tmp" > /etc/hosts || log "WARNING: cannot write /etc/hosts; node names won't resolve"
  rm -f "$DIR/hosts.tmp"
}
hosts_remove() {
  grep -q -F "$HOSTS_MARK" /etc/hosts 2>/dev/null || return 0
  grep -v -F "$HOSTS_MARK" /etc/hosts > "$DIR/hosts.tmp" || true
  cat "$DIR/hosts.tmp" > /etc/hosts; rm -f "$DIR/hosts.tmp"
}
etc_link_add() {
  [ "$ETC_LINK" = 1 ] || return 0
  mkdir -p /etc/slurm
  if [ -L /etc/slurm/slurm.conf ] || [ ! -e /etc/slurm/slurm.conf ]; then
    ln -sfn "$CONF" /etc/slurm/slurm.conf
  else
    log "/etc/slurm/slurm.conf exists and is not a symlink; leaving it (use SLURM_CONF=$CONF)"
  fi
}
etc_link_remove() {
  if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$CONF" ]; then
    rm -f /etc/slurm/slurm.conf
  fi
}

running_any() {
  pid_alive "$RUN/slurmctld.pid" slurmctld || pid_alive "$DIR/munge-run/munged.pid" munged
}

do_start() {
  [ "$(id -u)" = 0 ] || die "run as root"
  local t0=$SECONDS
  mkdir -p "$DIR"/{etc,log,run,spool/ctld}
  install_if_missing
  if running_any && [ -s "$CONF" ]; then
    log "already running under $DIR; checking the daemons"
  else
    write_configs
    # keep job state (and so the job-id counter, which must match the accounting DB)
    # but not node state: a node drained in an earlier run would stay drained
    rm -f "$DIR"/spool/ctld/node_state "$DIR"/spool/ctld/node_state.old
  fi
  hosts_add
  start_munge
  if [ "$ACCOUNTING" = 1 ]; then start_db; start_dbd; fi
  start_slurm
  etc_link_add
  log "ready in $((SECONDS - t0))s; export SLURM_CONF=$CONF"
}

do_stop() {
  if pid_alive "$RUN/slurmctld.pid" slurmctld; then
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs: $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 40); do [ -z "$(squeue -h -t R,CG -o %A 2>/dev/null)" ] && break; sleep 0.25; done
    fi
  fi
  local f n
  for f in "$RUN"/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$RUN/slurmctld.pid" slurmctld
  stop_pidfile "$RUN/slurmdbd.pid" slurmdbd
  stop_pidfile "$DIR/mysql/mariadbd.pid" mariadbd
  stop_pidfile "$DIR/munge-run/munged.pid" munged
  etc_link_remove
  hosts_remove
  # job steps of cancelled jobs are run by slurmstepd; report (never kill by name) leftovers
  for _ in 1 2 3 4 5 6 7 8; do
    n=$(ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 ~ /^slurmstepd/' | wc -l)
    [ "$n" = 0 ] && break; sleep 0.25
  done
  [ "$n" = 0 ] || log "note: $n slurmstepd process(es) still running on this machine"
  return 0
}

do_status() {
  local ok=0
  pid_alive "$DIR/munge-run/munged.pid" munged && echo "munged    $(cat "$DIR/munge-run/munged.pid")" || { echo "munged    down"; ok=1; }
  if [ -e "$DIR/etc/slurmdbd.conf" ]; then
    pid_alive "$DIR/mysql/mariadbd.pid" mariadbd && echo "mariadbd  $(cat "$DIR/mysql/mariadbd.pid")" || { echo "mariadbd  down"; ok=1; }
    pid_alive "$RUN/slurmdbd.pid" slurmdbd && echo "slurmdbd  $(cat "$RUN/slurmdbd.pid")" || { echo "slurmdbd  down"; ok=1; }
  fi
  pid_alive "$RUN/slurmctld.pid" slurmctld && echo "slurmctld $(cat "$RUN/slurmctld.pid")" || { echo "slurmctld down"; ok=1; }
  local f
  for f in "$RUN"/slurmd-*.pid; do
    [ -e "$f" ] || continue
    pid_alive "$f" slurmd && echo "slurmd    $(cat "$f") $(basename "$f" .pid)" || { echo "slurmd    down $(basename "$f" .pid)"; ok=1; }
  done
  [ $ok = 0 ] && sinfo -N -o '%N %T %C %m %G'
  return $ok
}

do_check() { # smoke test: batch job, 2-task step, 2-component het job (and sacct)
  local w t0=$SECONDS j h i
  w=$(mktemp -d "$DIR/check.XXXXXX")
  j=$(cd "$w" && sbatch --parsable -o "$w/wrap.out" --wrap 'hostname; sleep 1')
  timeout 60 srun -N1 -n2 -o "$w/srun-%t.out" hostname
  h=$(cd "$w" && sbatch --parsable -o "$w/het.out" <<'EOS'
#!/bin/bash
#SBATCH -n1 -c1
#SBATCH hetjob
#SBATCH -n1 -c1
srun --het-group=0,1 bash -c 'echo "het component procid=$SLURM_PROCID on $SLURMD_NODENAME"'
EOS
)
  for i in $(seq 1 240); do
    [ -z "$(squeue -h -j "$j,$h" -t PD,R,CG 2>/dev/null)" ] && break; sleep 0.25
  done
  [ -s "$w/wrap.out" ] || die "check: batch job $j wrote nothing"
  [ -s "$w/srun-0.out" ] && [ -s "$w/srun-1.out" ] || die "check: srun -n2 output missing"
  [ "$(grep -c 'het component' "$w/het.out" 2>/dev/null)" = 2 ] || die "check: het job $h did not run both components"
  if grep -q '^AccountingStorageType=accounting_storage/slurmdbd' "$CONF"; then
    for i in $(seq 1 40); do sacct -n -X -j "$h" -o State 2>/dev/null | grep -q COMPLETED && break; sleep 0.25; done
    sacct -n -X -j "$h" -o State | grep -q COMPLETED || die "check: sacct does not show het job $h"
  fi
  rm -rf "$w"
  log "check passed in $((SECONDS - t0))s (jobs $j, srun, het $h)"
}

case "$CMD" in
  start) do_start ;;
  check) do_check ;;
  stop) do_stop ;;
  status) do_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  reset) do_stop; rm -rf "$DIR"; log "removed $DIR" ;;
  *) echo "usage: $0 start|stop|status|check|env|reset [DIR]" >&2; exit 2 ;;
esac
