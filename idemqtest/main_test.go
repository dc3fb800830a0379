package idemqtest

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/testdb"
)

// TestMain checks that a run leaves no goroutine behind: the runtimes,
// pools and Recorders the kit starts are all stopped.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}
