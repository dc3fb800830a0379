#!/usr/bin/env bash
# floor.sh [ROUNDS] [SECONDS]: the share of broker-only that this machine
# leaves to batch mode and to the default, whatever the consumer's code.
#
# Each round runs, in an order reversed every other round:
#   - `idemq bench --modes broker-only` (consume and ack, no database): its
#     msgs/s R, its machine CPU per delivery B, and so the cores it kept
#     busy, U = R * B;
#   - pgbench (a C client, 8 connections) on batch.sql and on default.sql,
#     each for SECONDS: the machine CPU F that the least database work of
#     each mode costs per message, with no broker running.
# A consumer doing broker-only's work and that database work on the same
# cores uses at least B + F of CPU per message, so it runs at most at
# N / (B + F) msgs/s on N cores, and its share of broker-only is at most
#   (N / U) * B / (B + F).
# The line per round prints that bound; the last line, the medians.
#
# Run from the repository's root, with Postgres ($DATABASE_URL, default the
# local test database) and RabbitMQ ($AMQP_URL) up and nothing else busy:
#   docs/bench-floor/floor.sh 6 8
# $BROKER names another of the bench's brokers (nats, redis: $NATS_URL,
# $REDIS_URL); $IDEMQ an idemq binary to use instead of `go run ./cmd/idemq`.
set -euo pipefail

rounds=${1:-6}
secs=${2:-8}
case "$rounds$secs" in
*[!0-9]* | '') echo "usage: floor.sh [ROUNDS] [SECONDS]" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
db=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}
schema=idemq_floor_$$
cores=$(nproc)
broker=${BROKER:-rabbitmq}

if [ -n "${IDEMQ:-}" ]; then
	idemq=("$IDEMQ")
else
	idemq=(go run ./cmd/idemq)
fi
for tool in psql pgbench awk; do
	command -v "$tool" >/dev/null || { echo "floor.sh: $tool is not installed" >&2; exit 1; }
done

results=$(mktemp)
trap 'rm -f "$results"; psql "$db" -q -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true' EXIT
psql "$db" -q -v ON_ERROR_STOP=1 -c "CREATE SCHEMA $schema"
export PGOPTIONS="-c search_path=$schema"
psql "$db" -q -v ON_ERROR_STOP=1 -f "$here/setup.sql"

# busy: the machine's busy CPU so far, in ticks of 10 ms (/proc/stat).
busy() { awk 'NR == 1 { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }

# floor SCRIPT ROWS: prints "rows/s µs-per-row" for SECONDS of pgbench.
floor() {
	local b0 b1 out tx
	b0=$(busy)
	out=$(pgbench -n -M prepared -c 8 -j 2 -T "$secs" -f "$here/$1" "$db" 2>&1) || {
		echo "floor.sh: pgbench $1: $out" >&2
		return 1
	}
	b1=$(busy)
	tx=$(awk -F': ' '/number of transactions actually processed/ { split($2, a, "/"); print a[1] }' <<<"$out")
	awk -v tx="$tx" -v rows="$2" -v s="$secs" -v d=$((b1 - b0)) \
		'BEGIN { if (tx == 0) exit 1; printf "%.0f %.1f\n", tx * rows / s, d * 10000 / (tx * rows) }'
}

# brokeronly: prints "msgs/s µs-per-delivery" of one broker-only run.
brokeronly() {
	"${idemq[@]}" bench --broker "$broker" --messages 20000 --preload --modes broker-only --json |
		awk -F'[:,]' '{
			for (i = 1; i < NF; i++) {
				if ($i == "\"msgs_per_sec\"") r = $(i + 1)
				if ($i == "\"cpu_machine_us_per_msg\"") m = $(i + 1)
			}
		} END { if (r == "" || m == "") exit 1; printf "%.0f %.1f\n", r, m }'
}

printf '%s on %s, %d cores\n' "$broker" "$(date -u +%Y-%m-%dT%H:%MZ)" "$cores"
printf '%-6s %22s %30s %30s\n' round "broker-only msgs/s, µs" "batch.sql rows/s, µs, bound" "default.sql rows/s, µs, bound"
for ((r = 1; r <= rounds; r++)); do
	if ((r % 2)); then order="broker batch default"; else order="default batch broker"; fi
	R= B= Rb= Fb= Rd= Fd=
	for step in $order; do
		case $step in
		broker) read -r R B < <(brokeronly) ;;
		batch) read -r Rb Fb < <(floor batch.sql 100) ;;
		default) read -r Rd Fd < <(floor default.sql 32) ;;
		esac
	done
	for v in "$R" "$B" "$Rb" "$Fb" "$Rd" "$Fd"; do
		[ -n "$v" ] || { echo "floor.sh: round $r measured nothing (see above)" >&2; exit 1; }
	done
	awk -v r="$r" -v R="$R" -v B="$B" -v Rb="$Rb" -v Fb="$Fb" -v Rd="$Rd" -v Fd="$Fd" -v N="$cores" 'BEGIN {
		U = R * B / 1e6
		printf "%-6d %14d %7.1f %14d %6.1f %8.2f %14d %6.1f %8.2f\n", r, R, B, Rb, Fb, N / U * B / (B + Fb), Rd, Fd, N / U * B / (B + Fd)
	}' | tee -a "$results"
done
awk '
	function median(a, n,   i, j, t) {
		for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
		return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
	}
	{ n++; batch[n] = $6; def[n] = $9 }
	END { printf "median bound over %d rounds: batch mode %.2f of broker-only, the default %.2f\n", n, median(batch, n), median(def, n) }' "$results"
