package main

import (
	"regexp"
	"testing"

	"github.com/idemq/idemq/consumer/dedup"
)

// console --shard-url shows each shard's rows of a consumer and their
// total, and looks ids up on every shard.
func TestConsoleShards(t *testing.T) {
	t.Parallel()
	urls, s := migratedShards(t, 2)
	claim(t, s.Shard(0), dedup.Claim{Consumer: "ledger", MessageID: "m-0", Source: "payments", Partition: -1, Offset: -1})
	for _, id := range []string{"m-1", "m-2"} {
		claim(t, s.Shard(1), dedup.Claim{Consumer: "ledger", MessageID: id, Source: "refunds", Partition: -1, Offset: -1})
	}
	base, _ := startConsole(t, nil, "--read-only", "--shard-url", urls[0], "--shard-url", urls[1])
	b := newBrowser(t, base)
	page := b.get("/")
	contains(t, page, `<a href="/lookup?consumer=ledger">ledger</a>`, "Postgres, shard 1")
	rows := regexp.MustCompile(`(?s)<tr class="shard" data-shard="(\d)">\s*<td class="dim">shard \d</td>\s*<td class="num">(\d+)</td>`).FindAllStringSubmatch(page, -1)
	if len(rows) != 2 || rows[0][2] != "1" || rows[1][2] != "2" {
		t.Errorf("shard rows %v, want 1 on shard 0 and 2 on shard 1", rows)
	}
	if !regexp.MustCompile(`(?s)ledger</a>.*?<td class="num">3</td>`).MatchString(page) {
		t.Errorf("ledger's total is not 3:\n%s", page)
	}
	contains(t, b.get("/lookup?consumer=ledger&id=m-2"), "<strong>Applied</strong>", "<dd>refunds</dd>")

	want(t, idemq(t, "console", "--shard-url", urls[0], "--database-url", urls[1]), exitUsage, "", "--shard-url and --database-url")
}
