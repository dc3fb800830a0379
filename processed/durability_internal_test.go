package processed

import "testing"

// TestSyncStandbys: synchronous_standby_names in each of its forms says how
// many standbys a COMMIT waits for, and whether by quorum.
func TestSyncStandbys(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		names  string
		n      int
		quorum bool
	}{
		{"", 0, false},
		{"  ", 0, false},
		{"s1", 1, false},
		{"s1, s2", 1, false},
		{"*", 1, false},
		{`"First 2 (x)"`, 1, false},
		{"2 (s1, s2, s3)", 2, false},
		{"FIRST 2 (s1, s2, s3)", 2, false},
		{"first 3(s1,s2,s3)", 3, false},
		{"ANY 2 (s1, s2, s3)", 2, true},
		{"any 1 (*)", 1, true},
		{"firstone, s2", 1, false},
		{"anyone", 1, false},
		{"2", 1, false}, // a standby named 2
	} {
		n, quorum := syncStandbys(c.names)
		if n != c.n || quorum != c.quorum {
			t.Errorf("syncStandbys(%q) = %d, %v; want %d, %v", c.names, n, quorum, c.n, c.quorum)
		}
	}
	for v, want := range map[string]string{"off": "on", "local": "on", "on": "on", "remote_write": "remote_write", "remote_apply": "remote_apply"} {
		if got := raisedSyncCommit(v); got != want {
			t.Errorf("raisedSyncCommit(%q) = %q, want %q", v, got, want)
		}
	}
}
