package main

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testdb"
)

// TestStatusDurability: on a primary of the test's own with a standby, s1,
// status says a commit is on one node before the ack while s1 streams
// asynchronously, and that a failover can lose acked messages; once
// synchronous_standby_names names s1, on two. The JSON form has the same.
func TestStatusDurability(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts private Postgres clusters with standbys")
	}
	t.Parallel()
	primary := testdb.NewCluster(t)
	primary.Standby(t, "s1")
	args := []string{"--database-url", primary.URL()}
	want(t, idemq(t, append([]string{"migrate"}, args...)...), exitOK, "migrated", "")
	status := append([]string{"status", "--consumer", "billing"}, args...)

	want(t, idemq(t, status...), exitOK,
		"durability:      a commit is on 1 node before the ack (this primary; 1 standby streams asynchronously, s1: a failover to it can lose acked messages)\n", "")
	r := idemq(t, append(status, "--json")...)
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if d := got.Durability; d.Nodes != 1 || d.Standby || d.SynchronousCommit != "on" || d.SynchronousStandbyNames != "" ||
		!reflect.DeepEqual(d.Asynchronous, []string{"s1"}) || len(d.Synchronous) != 0 || !strings.HasPrefix(d.Summary, "a commit is on 1 node") {
		t.Errorf("asynchronous: durability %+v", d)
	}
	for _, s := range []string{`"synchronous_standbys": []`, `"asynchronous_standbys": [`} {
		want(t, r, exitOK, s, "")
	}

	primary.Set(t, "synchronous_standby_names", "FIRST 1 (s1)")
	const sync = "durability:      a commit is on 2 nodes before the ack (this primary and 1 synchronous standby, s1; synchronous_commit=on)\n"
	deadline := time.Now().Add(40 * time.Second) // sync_state changes when the walsender next hears from s1
	for r = idemq(t, status...); !strings.Contains(r.stdout, sync) && time.Now().Before(deadline); r = idemq(t, status...) {
		time.Sleep(50 * time.Millisecond)
	}
	want(t, r, exitOK, sync, "")
	r = idemq(t, append(status, "--json")...)
	got = statusReport{}
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if d := got.Durability; d.Nodes != 2 || d.SynchronousStandbyNames != "FIRST 1 (s1)" ||
		!reflect.DeepEqual(d.Synchronous, []string{"s1"}) || len(d.Asynchronous) != 0 {
		t.Errorf("synchronous: durability %+v", d)
	}
}
