#!/usr/bin/env bash
# testservices.sh starts (or finds) the services the integration tests need:
# PostgreSQL (the stand-in for CockroachDB) and ClickHouse, both private to
# this machine and bound to loopback only.
#
#   eval "$(deploy/testservices.sh start)"   # prints export lines on stdout
#   deploy/testservices.sh stop              # stops the servers it started
#   deploy/testservices.sh stop postgres     # or clickhouse: that one only
#
# start prints, on stdout and nothing else:
#   export LEDGER_TEST_PG_DSN=postgres://ledger@127.0.0.1:55432/ledger?sslmode=disable
#   export LEDGER_TEST_PG_TLS_CA=/tmp/ledger-testservices/postgres/tls/server.crt
#                             (the private server's certificate, for
#                             sslmode=verify-full; only when it serves TLS)
#   export LEDGER_TEST_CLICKHOUSE_ADDR=127.0.0.1:59000          (native protocol)
#   export LEDGER_TEST_CLICKHOUSE_HTTP=http://127.0.0.1:58123   (HTTP interface)
#   export LEDGER_TEST_CHROMIUM=/usr/bin/chromium               (headless browser)
#   export LEDGER_TEST_STARTED='postgres clickhouse'
#                             (the servers this start started, not those it
#                             found running, maybe none: a caller that
#                             stops only these leaves running what it did
#                             not start; the Makefile's targets do)
# Everything else (progress, apt output, server logs on failure) goes to
# stderr.
#
# For each service, in order: an address already in the environment that
# answers is reused; else a server answering on the private default address
# is reused (so start is idempotent and works unprivileged when the services
# are already up); else the Debian package is installed if missing (root
# only) and a private server is started with its data, config, logs and pid
# file under the state directory. stop stops only servers that have a pid
# file there.
#
# The private PostgreSQL always has ssl on (CockroachDB in production is
# reached over TLS), with a self-signed certificate for 127.0.0.1 that start
# generates with openssl into the state directory; plain connections are
# still accepted, so the DSN above keeps working. A private server found
# running with ssl off gets it turned on with ALTER SYSTEM and a reload, no
# restart.
#
# Environment:
#   LEDGER_TEST_STATE         state directory (default /tmp/ledger-testservices)
#   LEDGER_TEST_PG_DSN        reuse this PostgreSQL/CockroachDB if it answers
#                             (as given, when no psql or pg_isready can ask)
#   LEDGER_TEST_CLICKHOUSE_ADDR, LEDGER_TEST_CLICKHOUSE_HTTP
#                             reuse this ClickHouse if it answers (the HTTP
#                             URL optional)
#   LEDGER_TEST_CLICKHOUSE_DSN
#                             the tests use it: no ClickHouse is started
#   LEDGER_TEST_CHROMIUM      use this Chromium for the console's browser tests
#   LEDGER_TEST_WAIT          seconds to wait for a server to answer (default 90)
#
# Chromium is not a server: start finds it (or installs Debian's chromium
# package, as root) for the console's browser tests, which run it headless.
set -euo pipefail

STATE="${LEDGER_TEST_STATE:-/tmp/ledger-testservices}"
WAIT="${LEDGER_TEST_WAIT:-90}"

PG_HOST=127.0.0.1
PG_PORT=55432
PG_DSN_DEFAULT="postgres://ledger@${PG_HOST}:${PG_PORT}/ledger?sslmode=disable"
PG_DIR="$STATE/postgres"

CH_HOST=127.0.0.1
CH_TCP_PORT=59000
CH_HTTP_PORT=58123
CH_INTERSERVER_PORT=59009
CH_ADDR_DEFAULT="${CH_HOST}:${CH_TCP_PORT}"
CH_HTTP_DEFAULT="http://${CH_HOST}:${CH_HTTP_PORT}"
CH_DIR="$STATE/clickhouse"

log() { printf 'testservices: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}
is_root() { [ "$(id -u)" -eq 0 ]; }

# wait_ports_free waits, up to WAIT seconds, until no socket holds the
# loopback ports given: a server about to listen on one fails with
# "Address already in use" while an outgoing connection that happened to
# get it as its ephemeral port is open or in TIME_WAIT (60 s), and the
# suite's Kafka clients churn through that range. Without ss, it does not
# wait.
wait_ports_free() {
	command -v ss >/dev/null || return 0
	local filter="" p
	for p in "$@"; do filter="${filter:+$filter or }sport = :$p"; done
	local i=0
	while [ -n "$(ss -Htan "( $filter )" 2>/dev/null)" ]; do
		if [ "$i" -eq 0 ]; then log "waiting for ports $* to be released (sockets in TIME_WAIT or still open)"; fi
		i=$((i + 1))
		[ "$i" -le "$WAIT" ] || die "ports $* still held after ${WAIT}s: $(ss -Htan "( $filter )" | head -3)"
		sleep 1
	done
}

# apt_install installs Debian packages, quietly on stdout. apt-get update
# runs once per invocation, first: a fresh machine has no (or stale) lists.
APT_UPDATED=0
apt_install() {
	is_root || die "need packages $* but not root: install them or start the services yourself"
	command -v apt-get >/dev/null || die "need packages $* and apt-get is missing"
	if [ "$APT_UPDATED" -eq 0 ]; then
		log "apt-get update"
		apt-get update >&2
		APT_UPDATED=1
	fi
	log "apt-get install $*"
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2
}

# as_user runs a command as the given system user when root (servers refuse
# or should not run as root), and as the current user otherwise.
as_user() {
	local user="$1"
	shift
	if is_root; then
		runuser -u "$user" -- "$@"
	else
		"$@"
	fi
}

# pid_alive reports whether the pid in file $1 is a running process whose
# command line contains $2: a stale pid file (machine rebooted, pid reused)
# must never make stop signal an unrelated process.
pid_alive() {
	local pid
	[ -s "$1" ] || return 1
	pid="$(head -n1 "$1")"
	case "$pid" in '' | *[!0-9]*) return 1 ;; esac
	kill -0 "$pid" 2>/dev/null || return 1
	tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2"
}

# ---------------------------------------------------------------- PostgreSQL

pg_answers() {
	local dsn="$1"
	if command -v psql >/dev/null; then
		PGCONNECT_TIMEOUT=3 psql "$dsn" -XAtqc 'SELECT 1' >/dev/null 2>&1
	elif command -v pg_isready >/dev/null; then
		pg_isready -q -t 3 -d "$dsn" >/dev/null 2>&1
	else
		return 1
	fi
}

pg_bindir() {
	local d
	# The data directory's own version, if there is one: another
	# major version's binaries refuse it.
	if [ -r "$PG_DIR/data/PG_VERSION" ]; then
		d="/usr/lib/postgresql/$(cat "$PG_DIR/data/PG_VERSION")/bin"
		if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then
			echo "$d"
			return 0
		fi
	fi
	# Else the highest installed major version (/usr/lib/postgresql/N/bin:
	# N is the fifth field split on "/").
	for d in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -t/ -k5 -n -r); do
		if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then
			echo "$d"
			return 0
		fi
	done
	return 1
}

pg_start() {
	if [ -n "${LEDGER_TEST_PG_DSN:-}" ] && ! command -v psql >/dev/null && ! command -v pg_isready >/dev/null; then
		# Nothing here to check it with: the DSN a user set is theirs
		# to answer for, not to be replaced by a private server.
		log "postgres: LEDGER_TEST_PG_DSN is set, and neither psql nor pg_isready is here to check it: using it as given"
		PG_DSN="$LEDGER_TEST_PG_DSN"
		return 0
	fi
	if [ -n "${LEDGER_TEST_PG_DSN:-}" ] && pg_answers "$LEDGER_TEST_PG_DSN"; then
		log "postgres: reusing LEDGER_TEST_PG_DSN"
		PG_DSN="$LEDGER_TEST_PG_DSN"
		return 0
	fi
	if [ -n "${LEDGER_TEST_PG_DSN:-}" ]; then
		log "postgres: LEDGER_TEST_PG_DSN is set but does not answer; trying the private server"
	fi
	PG_DSN="$PG_DSN_DEFAULT"
	if pg_answers "$PG_DSN"; then
		log "postgres: reusing the server on ${PG_HOST}:${PG_PORT}"
		return 0
	fi

	local bindir
	if ! bindir="$(pg_bindir)" || ! command -v psql >/dev/null; then
		apt_install postgresql postgresql-client
		bindir="$(pg_bindir)" || die "postgres: initdb not found under /usr/lib/postgresql/*/bin after install"
	fi
	local user=postgres
	if is_root; then
		getent passwd "$user" >/dev/null || die "postgres: system user $user missing (the postgresql package creates it)"
	else
		user="$(id -un)"
	fi

	mkdir -p "$STATE"
	chmod 755 "$STATE" 2>/dev/null || true
	mkdir -p "$PG_DIR"
	if is_root; then chown "$user": "$PG_DIR"; fi
	local data="$PG_DIR/data" sock="$PG_DIR/sock" logf="$PG_DIR/postgres.log"
	as_user "$user" mkdir -p "$sock"

	if [ ! -s "$data/PG_VERSION" ]; then
		log "postgres: initdb in $data"
		rm -rf "$data"
		as_user "$user" "$bindir/initdb" -D "$data" -U postgres -A trust -E UTF8 --no-locale >&2
		# Loopback only, trust: a throwaway test cluster. fsync off: speed
		# over durability, nothing here outlives the test run.
		as_user "$user" tee -a "$data/postgresql.conf" >/dev/null <<-EOF
			listen_addresses = '${PG_HOST}'
			port = ${PG_PORT}
			unix_socket_directories = '${sock}'
			fsync = off
			synchronous_commit = off
			full_page_writes = off
			max_connections = 200
			max_pred_locks_per_transaction = 256
			log_min_messages = warning
		EOF
		as_user "$user" tee "$data/pg_hba.conf" >/dev/null <<-EOF
			local all all              trust
			host  all all 127.0.0.1/32 trust
			host  all all ::1/128      trust
		EOF
	fi

	if pid_alive "$data/postmaster.pid" postgres; then
		log "postgres: a server from $data is running but does not answer; stopping it"
		as_user "$user" "$bindir/pg_ctl" -D "$data" -m fast -w stop >&2 || true
	fi
	wait_ports_free "$PG_PORT"
	log "postgres: starting on ${PG_HOST}:${PG_PORT}"
	# The execution store's batched SERIALIZABLE statements read hundreds
	# of rows each: with the default thresholds PostgreSQL's SSI escalates
	# their predicate locks to whole pages and then to the relation, and
	# concurrent batches on disjoint keys fail with 40001 one after another
	# (CockroachDB tracks conflicts per key and has no such escalation).
	local ssi="-c max_pred_locks_per_transaction=1024 -c max_pred_locks_per_relation=8192 -c max_pred_locks_per_page=64"
	# pg_ctl knows its own pid file; this one marks "started by this
	# script". Both before the launch: a start that fails or is
	# interrupted from here on stops the server, which may come up after
	# pg_ctl gave up waiting for it.
	echo "$bindir" >"$PG_DIR/started-by-testservices"
	STARTED="${STARTED:+$STARTED }postgres"
	# 9>&-: the server must not inherit (and hold) this script's lock.
	if ! as_user "$user" "$bindir/pg_ctl" -D "$data" -l "$logf" -w -t "$WAIT" -o "$ssi" start >&2 9>&-; then
		log "postgres: did not start; log tail:"
		tail -n 50 "$logf" >&2 || true
		die "postgres: start failed"
	fi

	local psqlc=(psql -X -v ON_ERROR_STOP=1 -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -Atq)
	if [ "$("${psqlc[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = 'ledger'")" != 1 ]; then
		"${psqlc[@]}" -c "CREATE ROLE ledger LOGIN SUPERUSER" >&2
	fi
	if [ "$("${psqlc[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'ledger'")" != 1 ]; then
		"${psqlc[@]}" -c "CREATE DATABASE ledger OWNER ledger" >&2
	fi
	pg_answers "$PG_DSN" || die "postgres: started but $PG_DSN does not answer; see $logf"
	log "postgres: ready"
}

# pg_tls makes the private server serve TLS, if PG_DSN is the private
# server, and sets PG_TLS_CA to its certificate once it does. A failure
# here leaves the server as it was (plain connections work) and only
# LEDGER_TEST_PG_TLS_CA unset: the TLS tests then fail, saying why.
pg_tls() {
	PG_TLS_CA=""
	case "$PG_DSN" in
	*"@${PG_HOST}:${PG_PORT}/"*) ;;
	*) return 0 ;;
	esac
	local dir="$PG_DIR/tls"
	local crt="$dir/server.crt" key="$dir/server.key"
	local psqlc=(psql -X -v ON_ERROR_STOP=1 -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -Atq)
	local user=postgres
	is_root || user="$(id -un)"

	if [ "$("${psqlc[@]}" -c 'SHOW ssl' 2>/dev/null)" = on ]; then
		if [ "$("${psqlc[@]}" -c 'SHOW ssl_cert_file')" = "$crt" ] && [ -r "$crt" ]; then
			PG_TLS_CA="$crt"
		else
			log "postgres: ssl is on with a certificate this script did not make; LEDGER_TEST_PG_TLS_CA not set"
		fi
		return 0
	fi

	if [ ! -s "$crt" ] || [ ! -s "$key" ]; then
		if ! command -v openssl >/dev/null; then
			if ! is_root; then
				log "postgres: openssl missing and not root: the server stays without TLS"
				return 0
			fi
			apt_install openssl
		fi
		log "postgres: generating a self-signed TLS certificate in $dir"
		if ! as_user "$user" mkdir -p "$dir" ||
			! as_user "$user" openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
				-days 3650 -subj "/CN=ledger test postgres" \
				-addext "subjectAltName=IP:${PG_HOST},DNS:localhost" \
				-keyout "$key" -out "$crt" >&2 ||
			! as_user "$user" chmod 600 "$key" || ! as_user "$user" chmod 644 "$crt"; then
			log "postgres: could not write a certificate in $dir: the server stays without TLS"
			return 0
		fi
	fi

	log "postgres: turning ssl on"
	# The server reads these paths: single quotes doubled for SQL.
	if ! "${psqlc[@]}" -c "ALTER SYSTEM SET ssl_cert_file = '${crt//\'/\'\'}'" \
		-c "ALTER SYSTEM SET ssl_key_file = '${key//\'/\'\'}'" \
		-c "ALTER SYSTEM SET ssl = on" -c "SELECT pg_reload_conf()" >/dev/null; then
		log "postgres: could not turn ssl on: the server stays without TLS"
		return 0
	fi
	local deadline=$((SECONDS + 10))
	until [ "$("${psqlc[@]}" -c 'SHOW ssl')" = on ]; do
		if [ "$SECONDS" -ge "$deadline" ]; then
			# Undone, or the next start would fail on the same files.
			"${psqlc[@]}" -c "ALTER SYSTEM RESET ssl" -c "SELECT pg_reload_conf()" >/dev/null || true
			log "postgres: ssl stayed off after a reload (see $PG_DIR/postgres.log): the server stays without TLS"
			return 0
		fi
		sleep 0.2
	done
	PG_TLS_CA="$crt"
	log "postgres: ssl on"
}

pg_stop() {
	local marker="$PG_DIR/started-by-testservices" data="$PG_DIR/data"
	if [ ! -f "$marker" ]; then
		log "postgres: not started by this script; leaving it alone"
		return 0
	fi
	local bindir user=postgres
	bindir="$(cat "$marker")"
	is_root || user="$(id -un)"
	if pid_alive "$data/postmaster.pid" postgres; then
		log "postgres: stopping"
		as_user "$user" "$bindir/pg_ctl" -D "$data" -m fast -w stop >&2 ||
			die "postgres: pg_ctl stop failed"
	fi
	rm -f "$marker"
}

# ---------------------------------------------------------------- ClickHouse

ch_http_answers() {
	local url="$1" out
	command -v curl >/dev/null || return 1
	out="$(curl -fsS --max-time 3 "${url%/}/?query=SELECT%201" 2>/dev/null)" || return 1
	[ "$out" = 1 ]
}

ch_native_answers() {
	local addr="$1"
	if command -v clickhouse-client >/dev/null; then
		clickhouse-client --host "${addr%:*}" --port "${addr##*:}" -q 'SELECT 1' >/dev/null 2>&1
	else
		# Without the client, that the port takes connections.
		timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "${addr%:*}" "${addr##*:}" 2>/dev/null
	fi
}

ch_answers() { ch_http_answers "$2" && ch_native_answers "$1"; }

ch_server_bin() {
	local b
	for b in clickhouse-server /usr/bin/clickhouse-server; do
		if command -v "$b" >/dev/null; then
			command -v "$b"
			return 0
		fi
	done
	return 1
}

ch_write_config() {
	local conf="$CH_DIR/config.xml" users="$CH_DIR/users.xml"
	# ClickHouse 18.16 wants the <yandex> root element; current releases
	# still accept it.
	cat >"$conf" <<-EOF
		<?xml version="1.0"?>
		<yandex>
		    <logger>
		        <level>information</level>
		        <log>${CH_DIR}/log/clickhouse-server.log</log>
		        <errorlog>${CH_DIR}/log/clickhouse-server.err.log</errorlog>
		        <size>100M</size>
		        <count>3</count>
		    </logger>
		    <listen_host>${CH_HOST}</listen_host>
		    <tcp_port>${CH_TCP_PORT}</tcp_port>
		    <http_port>${CH_HTTP_PORT}</http_port>
		    <interserver_http_port>${CH_INTERSERVER_PORT}</interserver_http_port>
		    <interserver_http_host>${CH_HOST}</interserver_http_host>
		    <max_connections>1024</max_connections>
		    <keep_alive_timeout>3</keep_alive_timeout>
		    <max_concurrent_queries>100</max_concurrent_queries>
		    <uncompressed_cache_size>268435456</uncompressed_cache_size>
		    <mark_cache_size>268435456</mark_cache_size>
		    <path>${CH_DIR}/data/</path>
		    <tmp_path>${CH_DIR}/tmp/</tmp_path>
		    <user_files_path>${CH_DIR}/user_files/</user_files_path>
		    <format_schema_path>${CH_DIR}/format_schemas/</format_schema_path>
		    <users_config>${users}</users_config>
		    <default_profile>default</default_profile>
		    <default_database>default</default_database>
		    <timezone>UTC</timezone>
		    <mlock_executable>false</mlock_executable>
		    <builtin_dictionaries_reload_interval>3600</builtin_dictionaries_reload_interval>
		    <max_session_timeout>3600</max_session_timeout>
		    <default_session_timeout>60</default_session_timeout>
		</yandex>
	EOF
	cat >"$users" <<-EOF
		<?xml version="1.0"?>
		<yandex>
		    <profiles>
		        <default>
		            <max_memory_usage>4000000000</max_memory_usage>
		            <use_uncompressed_cache>0</use_uncompressed_cache>
		            <load_balancing>random</load_balancing>
		        </default>
		    </profiles>
		    <users>
		        <default>
		            <password></password>
		            <networks>
		                <ip>127.0.0.1</ip>
		                <ip>::1</ip>
		            </networks>
		            <profile>default</profile>
		            <quota>default</quota>
		        </default>
		    </users>
		    <quotas>
		        <default>
		            <interval>
		                <duration>3600</duration>
		                <queries>0</queries>
		                <errors>0</errors>
		                <result_rows>0</result_rows>
		                <read_rows>0</read_rows>
		                <execution_time>0</execution_time>
		            </interval>
		        </default>
		    </quotas>
		</yandex>
	EOF
}

ch_start() {
	if [ -n "${LEDGER_TEST_CLICKHOUSE_DSN:-}" ]; then
		# The tests use the DSN, which wins over the address.
		log "clickhouse: LEDGER_TEST_CLICKHOUSE_DSN is set: the tests use it, and no server is started"
		CH_ADDR="${LEDGER_TEST_CLICKHOUSE_ADDR:-}"
		CH_HTTP="${LEDGER_TEST_CLICKHOUSE_HTTP:-}"
		return 0
	fi
	if [ -n "${LEDGER_TEST_CLICKHOUSE_ADDR:-}" ] && ch_native_answers "$LEDGER_TEST_CLICKHOUSE_ADDR" &&
		{ [ -z "${LEDGER_TEST_CLICKHOUSE_HTTP:-}" ] || ! command -v curl >/dev/null || ch_http_answers "$LEDGER_TEST_CLICKHOUSE_HTTP"; }; then
		log "clickhouse: reusing LEDGER_TEST_CLICKHOUSE_ADDR"
		CH_ADDR="$LEDGER_TEST_CLICKHOUSE_ADDR"
		CH_HTTP="${LEDGER_TEST_CLICKHOUSE_HTTP:-}"
		return 0
	fi
	if [ -n "${LEDGER_TEST_CLICKHOUSE_ADDR:-}${LEDGER_TEST_CLICKHOUSE_HTTP:-}" ]; then
		log "clickhouse: LEDGER_TEST_CLICKHOUSE_ADDR (and _HTTP, if set) not answering; trying the private server"
	fi
	CH_ADDR="$CH_ADDR_DEFAULT"
	CH_HTTP="$CH_HTTP_DEFAULT"
	if ch_answers "$CH_ADDR" "$CH_HTTP"; then
		log "clickhouse: reusing the server on ${CH_ADDR}"
		return 0
	fi

	local bin
	if ! bin="$(ch_server_bin)" || ! command -v clickhouse-client >/dev/null || ! command -v curl >/dev/null; then
		apt_install clickhouse-server clickhouse-client curl ca-certificates
		bin="$(ch_server_bin)" || die "clickhouse: clickhouse-server not found after install"
	fi
	local user
	user="$(id -un)"
	if is_root && getent passwd clickhouse >/dev/null; then
		user=clickhouse
	fi

	mkdir -p "$STATE"
	chmod 755 "$STATE" 2>/dev/null || true
	mkdir -p "$CH_DIR"/{data,tmp,user_files,format_schemas,log}
	ch_write_config
	if is_root; then chown -R "$user": "$CH_DIR"; fi

	local pidf="$CH_DIR/clickhouse-server.pid"
	local logf="$CH_DIR/log/clickhouse-server.log" errf="$CH_DIR/log/clickhouse-server.err.log"
	local outf="$CH_DIR/log/stdout.log"
	if pid_alive "$pidf" clickhouse; then
		log "clickhouse: a server from $CH_DIR is running but does not answer; stopping it"
		ch_stop
	fi
	rm -f "$pidf"
	wait_ports_free "$CH_TCP_PORT" "$CH_HTTP_PORT" "$CH_INTERSERVER_PORT"
	log "clickhouse: starting on ${CH_ADDR} (http ${CH_HTTP})"
	# setsid + nohup: the server outlives this script and the caller's
	# terminal; 9>&- keeps it from holding this script's lock. setpriv (not
	# runuser, which forks and waits) and setsid (not a process group leader
	# here, so it does not fork) both exec, so $! is the server's own pid.
	# Not --daemon: 18.16 writes its pid file only then, and its daemon mode
	# exits silently when started this way.
	local drop=()
	if [ "$user" != "$(id -un)" ]; then
		drop=(setpriv --reuid="$user" --regid="$(id -g "$user")" --init-groups)
	fi
	# Before the launch: a start that fails or is interrupted from here
	# on stops the server (nothing, before its pid file is written).
	STARTED="${STARTED:+$STARTED }clickhouse"
	(
		cd "$CH_DIR"
		HOME="$CH_DIR" "${drop[@]}" setsid nohup "$bin" --config-file="$CH_DIR/config.xml" \
			</dev/null >"$outf" 2>&1 9>&- &
		echo $! >"$pidf"
	)
	local deadline=$((SECONDS + WAIT)) pid
	pid="$(head -n1 "$pidf")"
	until ch_answers "$CH_ADDR" "$CH_HTTP"; do
		# kill -0, not pid_alive: until the background job has exec'd
		# the server, its command line is this script's, and pid_alive
		# took a server still starting for one that had exited (and the
		# stop on the way out then left it running without a pid file, for later
		# runs to reuse and never stop). The pid is the job this script
		# has just started, not a stale file's.
		local exited=""
		kill -0 "$pid" 2>/dev/null || exited=1
		if [ -n "$exited" ] || [ "$SECONDS" -ge "$deadline" ]; then
			if [ -n "$exited" ]; then
				log "clickhouse: pid $pid exited before it answered; log tails:"
			else
				log "clickhouse: did not answer within ${WAIT}s; log tails:"
			fi
			tail -n 30 "$outf" >&2 2>/dev/null || true
			tail -n 30 "$errf" >&2 2>/dev/null || true
			tail -n 30 "$logf" >&2 2>/dev/null || true
			die "clickhouse: start failed" # start's exit stops it
		fi
		sleep 0.5
	done
	log "clickhouse: ready"
}

ch_stop() {
	local pidf="$CH_DIR/clickhouse-server.pid" pid
	if [ ! -f "$pidf" ]; then
		log "clickhouse: not started by this script; leaving it alone"
		return 0
	fi
	if pid_alive "$pidf" clickhouse; then
		pid="$(head -n1 "$pidf")"
		log "clickhouse: stopping pid $pid"
		kill -TERM "$pid" 2>/dev/null || true
		local deadline=$((SECONDS + 30))
		while kill -0 "$pid" 2>/dev/null; do
			if [ "$SECONDS" -ge "$deadline" ]; then
				log "clickhouse: pid $pid still running after 30s; killing"
				kill -KILL "$pid" 2>/dev/null || true
				break
			fi
			sleep 0.2
		done
	fi
	rm -f "$pidf"
}

# ---------------------------------------------------------------- chromium

# chromium_find sets CHROMIUM to a headless-capable Chromium: the one in
# the environment, Debian's, or Debian's installed now (root only).
chromium_find() {
	CHROMIUM="${LEDGER_TEST_CHROMIUM:-}"
	if [ -n "$CHROMIUM" ] && [ -x "$CHROMIUM" ]; then
		log "chromium: using $CHROMIUM"
		return
	fi
	CHROMIUM=/usr/bin/chromium
	if [ ! -x "$CHROMIUM" ]; then
		is_root || die "chromium is not installed and this is not root: install Debian's chromium package or set LEDGER_TEST_CHROMIUM"
		apt_install chromium
	fi
	[ -x "$CHROMIUM" ] || die "chromium: $CHROMIUM is missing after installing the package"
	log "chromium: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
}

# ---------------------------------------------------------------- main

# Serialize concurrent start/stop calls (several test runs on one machine)
# on a lock in the state directory.
lock() {
	mkdir -p "$STATE"
	chmod 755 "$STATE" 2>/dev/null || true
	# Read-only when the lock belongs to another user (root started the
	# services, an unprivileged run reuses them): flock needs no write access.
	if [ -e "$STATE/lock" ] && [ ! -w "$STATE/lock" ]; then
		exec 9<"$STATE/lock"
	else
		exec 9>>"$STATE/lock"
	fi
	flock -w "$((WAIT * 3))" 9 || die "another testservices.sh holds $STATE/lock"
}

# stop_one stops one service that start started.
stop_one() {
	case "$1" in
	clickhouse) ch_stop ;;
	postgres) pg_stop ;;
	*) die "stop: unknown service $1 (postgres, clickhouse)" ;;
	esac
}

case "${1:-}" in
start)
	lock
	STARTED=""
	# A start that fails (or is interrupted) stops what it started itself:
	# its caller, which gets no export lines, must not stop anything, for
	# it cannot tell what start found running.
	trap 'rc=$?; trap "" INT TERM; if [ "$rc" -ne 0 ]; then for svc in $STARTED; do (stop_one "$svc") || true; done; fi' EXIT
	trap 'exit 130' INT TERM
	pg_start
	pg_tls
	ch_start
	chromium_find
	# Quoted for the shell that sources them (bash: make test's SHELL):
	# DSNs carry "?" and "&", and a password may carry a quote.
	printf "export LEDGER_TEST_PG_DSN=%q\n" "$PG_DSN"
	if [ -n "$PG_TLS_CA" ]; then
		printf "export LEDGER_TEST_PG_TLS_CA=%q\n" "$PG_TLS_CA"
	fi
	printf "export LEDGER_TEST_CLICKHOUSE_ADDR=%q\n" "$CH_ADDR"
	printf "export LEDGER_TEST_CLICKHOUSE_HTTP=%q\n" "$CH_HTTP"
	printf "export LEDGER_TEST_CHROMIUM=%q\n" "$CHROMIUM"
	printf "export LEDGER_TEST_STARTED=%q\n" "$STARTED"
	trap - EXIT INT TERM
	;;
stop)
	lock
	shift
	[ "$#" -gt 0 ] || set -- clickhouse postgres
	# Each on its own: one that fails to stop leaves the others stopped.
	rc=0
	for svc in "$@"; do
		(stop_one "$svc") || rc=1
	done
	exit "$rc"
	;;
*)
	echo "usage: $0 start | stop [postgres] [clickhouse]" >&2
	exit 2
	;;
esac
