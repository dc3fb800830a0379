#!/usr/bin/env bash
# floor.sh [ROUNDS] [SECONDS]: an estimate of the share of broker-only that
# this machine leaves to batch mode and to the default, whatever the
# consumer's own code.
#
# Each round runs, in an order reversed every other round:
#   - `idemq bench --modes broker-only` (consume and ack, no database): its
#     msgs/s R, its machine CPU per delivery B, and so the cores it kept
#     busy, U = R * B;
#   - pgbench (a C client, 8 connections; the broker idle) on batch.sql and
#     on default.sql, each for SECONDS on emptied tables: the machine CPU F
#     that the least database work of each mode costs per message; and on
#     idemq-batch.sql, batch mode's work with idemq's own claim.
# A consumer whose work outside the database costs what broker-only's does
# (B) uses B + F of CPU per message, so it runs at most at N / (B + F)
# msgs/s on N cores, and its share of broker-only is at most
#   (N / U) * B / (B + F).
# That is an estimate, not a proof: a consumer that spends less than B
# outside the database (fewer acks, say) can pass it.
# The line per round prints that ceiling; the last line, the medians.
#
# Run with Postgres ($DATABASE_URL, default the local test database) and
# RabbitMQ ($AMQP_URL) up and nothing else busy:
#   docs/bench-floor/floor.sh 6 8
# $BROKER names another of the bench's brokers (nats, redis: $NATS_URL,
# $REDIS_URL); $IDEMQ an idemq binary to use instead of `go run ./cmd/idemq`.
set -euo pipefail

rounds=${1:-6}
secs=${2:-8}
case "$rounds:$secs" in
*[!0-9:]* | :* | *:) echo "usage: floor.sh [ROUNDS] [SECONDS], both whole numbers" >&2; exit 2 ;;
esac
rounds=$((10#$rounds)) secs=$((10#$secs))
if ((rounds < 1 || secs < 1)); then
	echo "usage: floor.sh [ROUNDS] [SECONDS], both at least 1" >&2
	exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.." # the repository's root, for go run ./cmd/idemq
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
# sql: psql and pgbench in the scratch schema (not idemq bench).
sql() { PGOPTIONS="-c search_path=$schema" "$@"; }
sql psql "$db" -q -v ON_ERROR_STOP=1 -f "$here/setup.sql"
"${idemq[@]}" migrate --database-url "$db" --schema "$schema" >/dev/null

# busy: the machine's busy CPU so far, in ticks of 10 ms (/proc/stat).
busy() { awk 'NR == 1 { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }

# floor SCRIPT ROWS: prints "rows/s µs-per-row" for SECONDS of pgbench.
floor() {
	local b0 b1 out tx
	# Emptied first, so that no round claims into a larger index.
	sql psql "$db" -q -v ON_ERROR_STOP=1 -c "TRUNCATE claims, ledger, processed_messages"
	b0=$(busy)
	out=$(sql pgbench -n -M prepared -c 8 -j 2 -T "$secs" -f "$here/$1" "$db" 2>&1) || {
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
printf '%-6s %19s %26s %26s %26s\n' round "broker-only msgs/s µs" "batch.sql rows/s µs ceiling" "idemq-batch.sql rows/s µs ceiling" "default.sql rows/s µs ceiling"
for ((r = 1; r <= rounds; r++)); do
	if ((r % 2)); then order="broker batch idemq default"; else order="default idemq batch broker"; fi
	for step in $order; do
		case $step in
		broker) out=$(brokeronly) || { echo "floor.sh: round $r: broker-only measured nothing" >&2; exit 1; }
			read -r R B <<<"$out" ;;
		batch) out=$(floor batch.sql 100) || { echo "floor.sh: round $r: batch.sql measured nothing" >&2; exit 1; }
			read -r Rb Fb <<<"$out" ;;
		idemq) out=$(floor idemq-batch.sql 100) || { echo "floor.sh: round $r: idemq-batch.sql measured nothing" >&2; exit 1; }
			read -r Ri Fi <<<"$out" ;;
		default) out=$(floor default.sql 32) || { echo "floor.sh: round $r: default.sql measured nothing" >&2; exit 1; }
			read -r Rd Fd <<<"$out" ;;
		esac
	done
	awk -v r="$r" -v R="$R" -v B="$B" -v Rb="$Rb" -v Fb="$Fb" -v Ri="$Ri" -v Fi="$Fi" -v Rd="$Rd" -v Fd="$Fd" -v N="$cores" 'BEGIN {
		k = N / (R * B / 1e6) * B
		printf "%-6d %12d %6.1f %12d %6.1f %6.2f %12d %6.1f %6.2f %12d %6.1f %6.2f\n", r, R, B, Rb, Fb, k / (B + Fb), Ri, Fi, k / (B + Fi), Rd, Fd, k / (B + Fd)
	}' | tee -a "$results"
done
awk '
	function median(a, n,   i, j, t) {
		for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
		return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
	}
	{ n++; batch[n] = $6; idemq[n] = $9; def[n] = $12 }
	END { printf "median ceiling over %d rounds: batch mode %.2f of broker-only (%.2f with idemq'"'"'s claim), the default %.2f\n", n, median(batch, n), median(idemq, n), median(def, n) }' "$results"
