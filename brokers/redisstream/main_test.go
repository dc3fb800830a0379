package redisstream_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/testdb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}
