package chaos

import (
	"context"
	"slices"
	"sync"
	"syscall"
	"time"
)

// nemesis injects the scenario's process and service faults over the
// publishing window, each kind on its own schedule, and returns when all
// are done. Faults inside the workers (Postgres resets and latency, AMQP
// drops, self-kills after COMMIT, slow handlers) are configured when each
// worker starts.
func (r *run) nemesis(ctx context.Context) {
	window := r.s.PublishOver
	var wg sync.WaitGroup
	goFault := func(fn func()) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn()
		}()
	}
	r.phase.Store("running")

	if n := r.s.Kills; n > 0 {
		goFault(func() {
			at := make([]time.Duration, n)
			for i := range at {
				at[i] = window/20 + time.Duration(r.float()*float64(window*19/20))
			}
			slices.Sort(at)
			for _, t := range at {
				if !sleepCtx(ctx, time.Until(r.start.Add(t))) {
					return
				}
				// Wait for a live worker, at most a few seconds.
				for try := 0; try < 100 && !r.killRandom(); try++ {
					if !sleepCtx(ctx, 50*time.Millisecond) {
						return
					}
				}
			}
		})
	}
	// restarts restarts a server n times, the i-th at at(i) into the
	// window, each down for 200ms to 1s.
	restarts := func(n int, at func(i int) time.Duration, label, kind string, restart func(context.Context, time.Duration) error) {
		goFault(func() {
			for i := 1; i <= n; i++ {
				if !sleepCtx(ctx, time.Until(r.start.Add(at(i)))) {
					return
				}
				r.h.event("scenario %s: %s %d/%d", r.s.Name, label, i, n)
				r.inject(kind, 1)
				if err := restart(ctx, time.Duration(200+r.intn(800))*time.Millisecond); err != nil {
					r.mu.Lock()
					r.exitProblems = append(r.exitProblems, kind+": "+err.Error())
					r.mu.Unlock()
					return
				}
			}
		})
	}
	if n := r.s.PGRestarts; n > 0 && r.h.pg != nil {
		restarts(n, func(i int) time.Duration { return window * time.Duration(i) / time.Duration(n+1) },
			"pg_ctl -m immediate restart", "pg-restart", r.h.pg.Restart)
	}
	if n := r.s.RabbitRestarts; n > 0 && r.h.rabbit != nil {
		// Offset from the Postgres restarts.
		restarts(n, func(i int) time.Duration { return window*time.Duration(2*i-1)/time.Duration(2*n+1) + window/10 },
			"RabbitMQ node SIGKILL restart", "rabbitmq-restart", r.h.rabbit.Restart)
	}
	if r.s.Cluster && len(r.s.clusterPlan()) > 0 {
		ops := r.rabbitOps
		if r.s.Broker == BrokerNATS {
			ops = r.natsOps
		}
		goFault(func() { r.clusterFaults(ctx, ops()) })
	}
	if r.s.PGFailover && r.db.pair != nil {
		goFault(func() {
			if !sleepCtx(ctx, time.Until(r.start.Add(window/2))) {
				return
			}
			t0 := time.Now()
			r.inject("pg-failover", 1)
			if err := r.db.pair.Failover(ctx); err != nil {
				r.problem("pg-failover: " + err.Error())
				return
			}
			r.h.event("scenario %s: pg-failover: primary crashed at +%s, standby promoted %s later", r.s.Name,
				t0.Sub(r.start).Round(100*time.Millisecond), time.Since(t0).Round(10*time.Millisecond))
		})
	}
	if r.s.ReshardFrom > 0 && r.shards != nil {
		goFault(func() {
			if sleepCtx(ctx, time.Until(r.start.Add(window/2))) {
				r.reshard(ctx)
			}
		})
	}
	if n := r.s.ShardRestarts; n > 0 && r.shards != nil {
		// Offset from the reshard at the middle.
		restarts(n, func(i int) time.Duration { return window*time.Duration(2*i-1)/time.Duration(2*n+1) + window/10 },
			"shard pg_ctl -m immediate restart", "shard-restart", r.restartShard)
	}
	if n := r.s.NATSRestarts; n > 0 && r.h.natsSrv != nil {
		restarts(n, func(i int) time.Duration { return window*time.Duration(2*i-1)/time.Duration(2*n+1) + window/10 },
			"nats-server SIGKILL restart", "nats-restart", r.h.natsSrv.Restart)
	}
	if n := r.s.RedisRestarts; n > 0 && r.h.redisSrv != nil {
		restarts(n, func(i int) time.Duration { return window*time.Duration(2*i-1)/time.Duration(2*n+1) + window/10 },
			"redis-server SIGKILL restart", "redis-restart", r.h.redisSrv.Restart)
	}
	if n := r.s.ConnCuts; n > 0 && r.chain != nil {
		cuts := []struct {
			kind string
			p    *Proxy
		}{{"pg-cut", r.chain.pgProxy}, {"amqp-cut", r.chain.amqpProxy}, {"nats-cut", r.chain.natsProxy}}
		goFault(func() {
			for i := range n {
				if !sleepCtx(ctx, time.Until(r.start.Add(window*time.Duration(2*i+1)/time.Duration(2*n)))) {
					return
				}
				c := cuts[i%len(cuts)]
				dropped := c.p.DropAll()
				r.inject(c.kind, 1)
				r.h.event("scenario %s: %s %d/%d: %d connections cut", r.s.Name, c.kind, i+1, n, dropped)
			}
		})
	}
	if n := r.s.Rebalances; n > 0 {
		goFault(func() {
			for i := 0; i < n; i++ {
				at := window * time.Duration(i) / time.Duration(n)
				if !sleepCtx(ctx, time.Until(r.start.Add(at))) {
					return
				}
				slot := r.s.Workers + i
				k, p, err := r.spawn(slot)
				if err != nil {
					return
				}
				r.inject("member-join", 1)
				stay := window/time.Duration(2*n) + time.Duration(r.intn(1000))*time.Millisecond
				select {
				case <-p.done: // killed by the nemesis meanwhile
				case <-time.After(stay):
					r.inject("member-leave", 1)
					_ = p.cmd.Process.Signal(syscall.SIGTERM)
					select {
					case <-p.done:
					case <-time.After(40 * time.Second):
						_ = p.cmd.Process.Kill()
						<-p.done
					}
				case <-ctx.Done():
					_ = p.cmd.Process.Kill()
					<-p.done
				}
				r.noteExit(k, p)
			}
		})
	}
	wg.Wait()
}
