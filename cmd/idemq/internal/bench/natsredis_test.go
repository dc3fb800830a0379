package bench

import (
	"errors"
	"strings"
	"testing"
)

func TestAllModesNATS(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs every bench mode")
	}
	cfg := smallConfig(BrokerNATS)
	rs, err := run(t, cfg)
	checkAll(t, cfg, rs, err)
}

func TestAllModesRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs every bench mode")
	}
	cfg := smallConfig(BrokerRedis)
	rs, err := run(t, cfg)
	checkAll(t, cfg, rs, err)
}

// TestUnreachableNATSAndRedis: as TestUnreachableSetup, for the NATS and
// Redis brokers.
func TestUnreachableNATSAndRedis(t *testing.T) {
	const secret = "hunter2Secret"
	addr := deadAddr(t)
	for _, c := range []struct {
		name string
		cfg  func(*Config)
		want string
	}{
		{"nats", func(c *Config) { c.Broker, c.NATSURL = BrokerNATS, "nats://app:"+secret+"@"+addr },
			"connect to NATS at nats://app:xxxxx@" + addr},
		{"redis", func(c *Config) { c.Broker, c.RedisURL = BrokerRedis, "redis://app:"+secret+"@"+addr+"/0" },
			"connect to Redis at redis://app:xxxxx@" + addr + "/0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := smallConfig(BrokerMemory)
			c.cfg(&cfg)
			rs, err := run(t, cfg)
			if err == nil || !strings.Contains(err.Error(), c.want) || len(rs) != 0 {
				t.Fatalf("Run: %d results, %v; want none and an error containing %q", len(rs), err, c.want)
			}
			if errors.Is(err, ErrVerify) || strings.Contains(err.Error(), secret) || strings.HasPrefix(err.Error(), "bench:") {
				t.Fatalf("Run: %v", err)
			}
		})
	}
}
