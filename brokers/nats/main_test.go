package natsjs_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/internal/testdb"
)

func TestMain(m *testing.M) {
	_ = natstest.EnsureAnchor(serverURL()) // see natstest
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}
