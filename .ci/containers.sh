#!/usr/bin/env bash
# .ci/containers.sh: prepare Docker and local test images for idemq's
# integration suite (go test -tags integration ./integration/...).
#
# This machine class has no image registry, so the official images
# (postgres, rabbitmq, apache/kafka) cannot be pulled. Instead this script:
#   1. installs docker.io and debootstrap with apt-get if they are missing;
#   2. starts dockerd if `docker info` fails, and waits for it;
#   3. builds, unless `docker image inspect` finds them already (cache by tag):
#        idemq-test/postgres:15   Debian bookworm minbase + postgresql-15
#        idemq-test/rabbitmq:3    Debian bookworm minbase + rabbitmq-server
#        idemq-test/kfake:latest  cmd/kfake-server: franz-go kfake, a
#                                 Kafka-protocol TEST broker, not Apache Kafka
#      Each image carries its own start command, so the Go suite treats it
#      like the official image it replaces.
#   4. exports the variables the suite needs.
#
# Use it either way (it is idempotent and needs root, no stdin):
#   source .ci/containers.sh            # exports into the current shell
#   eval "$(bash .ci/containers.sh)"    # prints `export ...` lines on stdout
# Progress and timings go to stderr. Set IDEMQ_CONTAINERS_REBUILD=1 to rebuild
# the images even if they exist.

_idemq_containers_main() (
	set -euo pipefail

	repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
	work=${IDEMQ_CONTAINERS_WORKDIR:-/var/tmp/idemq-images}
	suite=bookworm
	pg_image=idemq-test/postgres:15
	rmq_image=idemq-test/rabbitmq:3
	kfake_image=idemq-test/kfake:latest

	log() { printf '[containers %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

	# 1. Packages.
	missing=()
	command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
	command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
	if ((${#missing[@]})); then
		log "apt-get install ${missing[*]}"
		t0=$SECONDS
		export DEBIAN_FRONTEND=noninteractive
		# .ci/run installs packages too: take its apt lock (see there).
		flock -w 900 /tmp/idemq-apt.lock apt-get -o DPkg::Lock::Timeout=600 -o APT::Lock::Timeout=600 update -qq >&2
		flock -w 900 /tmp/idemq-apt.lock apt-get -o DPkg::Lock::Timeout=600 -o APT::Lock::Timeout=600 install -y -qq "${missing[@]}" </dev/null >&2
		log "installed ${missing[*]} in $((SECONDS - t0))s"
	fi

	# 2. Engine.
	if ! docker info >/dev/null 2>&1; then
		log "starting dockerd (log: /var/log/dockerd.log)"
		nohup dockerd >/var/log/dockerd.log 2>&1 </dev/null &
		for _ in $(seq 1 60); do
			docker info >/dev/null 2>&1 && break
			sleep 1
		done
		if ! docker info >/dev/null 2>&1; then
			log "dockerd did not come up in 60s; tail of /var/log/dockerd.log:"
			tail -n 30 /var/log/dockerd.log >&2 || true
			exit 1
		fi
	fi

	have() { [[ -z ${IDEMQ_CONTAINERS_REBUILD:-} ]] && docker image inspect "$1" >/dev/null 2>&1; }

	mkdir -p "$work"

	# debootstrap_image NAME PACKAGE START_SCRIPT_FILE PATH [IMPORT_CHANGES...]
	debootstrap_image() {
		local name=$1 pkg=$2 script=$3 path=$4
		shift 4
		local dir="$work/${name//[\/:]/_}"
		local t0=$SECONDS
		rm -rf "$dir"
		log "$name: debootstrap $suite with $pkg"
		if ! debootstrap --variant=minbase --include="$pkg" "$suite" "$dir" >"$dir.log" 2>&1; then
			log "$name: debootstrap failed; tail of $dir.log:"
			tail -n 30 "$dir.log" >&2
			return 1
		fi
		local t1=$SECONDS
		install -m 0755 "$script" "$dir/usr/local/bin/idemq-start"
		rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
		tar -C "$dir" -c . | docker import \
			-c "ENV PATH=$path" \
			-c 'CMD ["/usr/local/bin/idemq-start"]' \
			-c "LABEL org.opencontainers.image.description=\"idemq integration-test image: Debian $suite minbase + $pkg\"" \
			"$@" \
			-m "idemq integration-test image: Debian $suite minbase + $pkg, built by .ci/containers.sh" \
			- "$name" >/dev/null
		rm -rf "$dir"
		log "$name: built in $((SECONDS - t0))s (debootstrap $((t1 - t0))s, import $((SECONDS - t1))s)"
	}

	scripts="$work/scripts"
	mkdir -p "$scripts"

	# The Postgres start command, like the official image's with
	# POSTGRES_HOST_AUTH_METHOD=trust: user postgres, database postgres,
	# trust auth from anywhere, listening on every address. The cluster is
	# created on the first start only, so a restarted container keeps its
	# data. setpriv execs (no fork), so postgres is PID 1 and gets the stop
	# signal itself.
	cat >"$scripts/postgres-start" <<'EOF'
#!/bin/sh
set -eu
PGDATA=${PGDATA:-/var/lib/postgresql/data}
mkdir -p /var/run/postgresql "$PGDATA"
chown postgres:postgres /var/run/postgresql "$PGDATA"
chmod 0700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
	setpriv --reuid=postgres --regid=postgres --init-groups \
		initdb -D "$PGDATA" -U postgres -A trust -E UTF8 --locale=C.UTF-8 >/dev/null
	echo "host all all all trust" >>"$PGDATA/pg_hba.conf"
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
	postgres -D "$PGDATA" -c listen_addresses='*' "$@"
EOF

	# The RabbitMQ start command: allow guest from outside the container
	# (the official image does the same), then run the server in the
	# foreground as PID 1.
	cat >"$scripts/rabbitmq-start" <<'EOF'
#!/bin/sh
set -eu
mkdir -p /etc/rabbitmq /var/lib/rabbitmq /var/log/rabbitmq
echo 'loopback_users = none' >/etc/rabbitmq/rabbitmq.conf
chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq
export HOME=/var/lib/rabbitmq RABBITMQ_LOGS=-
exec setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups /usr/lib/rabbitmq/bin/rabbitmq-server
EOF

	pids=()
	names=()
	if have "$pg_image"; then
		log "$pg_image: cached"
	else
		debootstrap_image "$pg_image" postgresql-15 "$scripts/postgres-start" \
			/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
			-c 'ENV LANG=C.UTF-8' -c 'ENV PGDATA=/var/lib/postgresql/data' -c 'EXPOSE 5432' &
		pids+=($!)
		names+=("$pg_image")
	fi
	if have "$rmq_image"; then
		log "$rmq_image: cached"
	else
		debootstrap_image "$rmq_image" rabbitmq-server "$scripts/rabbitmq-start" \
			/usr/lib/rabbitmq/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
			-c 'ENV LANG=C.UTF-8' -c 'EXPOSE 5672' &
		pids+=($!)
		names+=("$rmq_image")
	fi
	if have "$kfake_image"; then
		log "$kfake_image: cached"
	else
		(
			t0=$SECONDS
			dir="$work/kfake"
			rm -rf "$dir" && mkdir -p "$dir"
			log "$kfake_image: go build ./cmd/kfake-server (static)"
			(cd "$repo" && CGO_ENABLED=0 go build -trimpath -o "$dir/kfake-server" ./cmd/kfake-server)
			tar -C "$dir" -c kfake-server | docker import \
				-c 'ENTRYPOINT ["/kfake-server"]' \
				-c 'LABEL org.opencontainers.image.title="idemq-test/kfake" org.opencontainers.image.description="Kafka-protocol TEST broker: franz-go kfake served by idemq cmd/kfake-server. NOT Apache Kafka: in-memory, no durability or replication."' \
				-c 'EXPOSE 9092' \
				-m 'Kafka-protocol TEST broker: franz-go kfake served by idemq cmd/kfake-server. NOT Apache Kafka.' \
				- "$kfake_image" >/dev/null
			rm -rf "$dir"
			log "$kfake_image: built in $((SECONDS - t0))s"
		) &
		pids+=($!)
		names+=("$kfake_image")
	fi
	failed=0
	for i in "${!pids[@]}"; do
		if ! wait "${pids[$i]}"; then
			log "${names[$i]}: build FAILED"
			failed=1
		fi
	done
	exit "$failed"
)

_idemq_containers_env() {
	cat <<'EOF'
export IDEMQ_TEST_POSTGRES_IMAGE=idemq-test/postgres:15
export IDEMQ_TEST_RABBITMQ_IMAGE=idemq-test/rabbitmq:3
export IDEMQ_TEST_KAFKA_IMAGE=idemq-test/kfake:latest
export TESTCONTAINERS_RYUK_DISABLED=true
export TESTCONTAINERS_HOST_OVERRIDE=127.0.0.1
EOF
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
	# Sourced: build, then export into the caller's shell.
	if _idemq_containers_main; then
		eval "$(_idemq_containers_env)"
		_idemq_containers_env >&2
		unset -f _idemq_containers_main _idemq_containers_env
	else
		unset -f _idemq_containers_main _idemq_containers_env
		return 1
	fi
else
	_idemq_containers_main || exit 1
	_idemq_containers_env
fi
