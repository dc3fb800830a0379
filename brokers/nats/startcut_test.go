package natsjs_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/internal/testlog"
)

// startCutBound is the longest a Source may take from NewSource to its
// first delivery while one of its servers is cut off and the cluster
// answers without it: the silent server costs one dial timeout (2 s)
// before the next is tried. With a 10 s dial timeout it took 10 s.
const startCutBound = 5 * time.Second

// startElectionBound is the same while the cut-off server's stream is
// still electing a new leader: a few seconds for the election, a start
// request lost to it sent again after 5 s, and a dial timeout. A lost
// request used to wait out NewSource's context (a minute here).
const startElectionBound = 20 * time.Second

// TestNewSourceWhileAServerIsCutOff: a Source started while one server of
// the cluster it is given is cut off by a partition (every packet
// dropped), and that server led the meta layer, the stream and the
// durable, receives within
// startElectionBound, and once the others have elected whatever it led,
// within startCutBound, even when the client tries the cut-off server
// first.
func TestNewSourceWhileAServerIsCutOff(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a NATS cluster and partitions it")
	}
	t.Parallel()
	c := startCluster(t, true)
	ctx := testCtx(t, 4*time.Minute)
	// More messages than the rounds take: each round's Source buffers a
	// few and gives back those it did not hand out at Close.
	const rounds = 6
	j, stream, subject, durable := clusterStream(ctx, t, c, 200)
	cut := c.Node("n3")
	cfg := natsjs.Config{URL: c.URLs(), Stream: stream, Subject: subject, Durable: durable}
	// The worst order: the cut-off server first, tried first.
	worst := cfg
	worst.URL = cut.URL + "," + c.Node("n1").URL + "," + c.Node("n2").URL
	worst.Options = []nats.Option{nats.DontRandomize()}
	// The durable exists before the cut, as a restarted worker's does.
	first := newSource(t, cfg)
	d, err := first.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Ack(ctx); err != nil {
		t.Fatal(err)
	}
	_ = first.Close()
	leadOn(ctx, t, c, j, stream, durable, cut.Name)

	if err := cut.Partition(); err != nil {
		t.Fatal(err)
	}
	cutAt := time.Now()
	round := func(i int, rcfg natsjs.Config, bound time.Duration) {
		t.Helper()
		at := time.Since(cutAt)
		t0 := time.Now()
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		src, err := natsjs.NewSource(sctx, rcfg)
		if err != nil {
			t.Fatalf("round %d: NewSource after %s: %v", i, time.Since(t0).Round(time.Millisecond), err)
		}
		made := time.Since(t0)
		log, buf := testlog.New(slog.LevelDebug)
		src.Configure(consumer.SourceSettings{Logger: log})
		d, err := src.Receive(sctx)
		took := time.Since(t0)
		if err == nil {
			err = d.Ack(sctx)
		}
		_ = src.Close()
		t.Logf("round %d at +%s (cut-off server first: %t): NewSource %s, first delivery %s\n%s", i, at.Round(time.Millisecond),
			rcfg.URL == worst.URL, made.Round(time.Millisecond), took.Round(time.Millisecond), buf)
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		if took > bound {
			t.Errorf("round %d: the first delivery took %s, longer than %s", i, took.Round(time.Millisecond), bound)
		}
	}
	// During the stream's election.
	round(0, cfg, startElectionBound)

	// The cluster's own part: whatever the cut-off server led (the meta
	// layer, the stream, the durable) is elected again on the others.
	live, err := nats.Connect(c.Node("n1").URL)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	lj, err := jetstream.New(live)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, "the stream and the durable led by servers not cut off", func() bool {
		ictx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		st, err := lj.Stream(ictx, stream)
		if err != nil {
			return false
		}
		cons, err := lj.Consumer(ictx, stream, durable)
		if err != nil {
			return false
		}
		si, ci := st.CachedInfo(), cons.CachedInfo()
		return si.Cluster != nil && si.Cluster.Leader != "" && si.Cluster.Leader != cut.Name &&
			ci.Cluster != nil && ci.Cluster.Leader != "" && ci.Cluster.Leader != cut.Name
	})
	t.Logf("cut off %s; the cluster answered without it %s later", cut.Name, time.Since(cutAt).Round(time.Millisecond))
	for i := 1; i <= rounds; i++ {
		rcfg := cfg
		if i%2 == 1 {
			rcfg = worst
		}
		round(i, rcfg, startCutBound)
	}
}

// leadOn steps the meta layer's leader, the stream's and the durable's
// down until the named server leads all three.
func leadOn(ctx context.Context, t *testing.T, c *natstest.Cluster, j jetstream.JetStream, stream, durable, server string) {
	t.Helper()
	nc := j.Conn()
	lead := func(what, stepdown string, leader func() (string, error)) {
		for range 30 {
			l, err := leader()
			if err != nil {
				t.Fatal(err)
			}
			if l == server {
				return
			}
			if _, err := nc.RequestWithContext(ctx, stepdown, nil); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Second)
		}
		t.Fatalf("%s never came to lead %s", server, what)
	}
	lead("the meta layer", "$JS.API.META.LEADER.STEPDOWN", func() (string, error) {
		return c.Node(server).MetaLeader(ctx)
	})
	lead("the stream", "$JS.API.STREAM.LEADER.STEPDOWN."+stream, func() (string, error) {
		st, err := j.Stream(ctx, stream)
		if err != nil || st.CachedInfo().Cluster == nil {
			return "", err
		}
		return st.CachedInfo().Cluster.Leader, nil
	})
	lead("the durable", "$JS.API.CONSUMER.LEADER.STEPDOWN."+stream+"."+durable, func() (string, error) {
		c, err := j.Consumer(ctx, stream, durable)
		if err != nil || c.CachedInfo().Cluster == nil {
			return "", err
		}
		return c.CachedInfo().Cluster.Leader, nil
	})
}
