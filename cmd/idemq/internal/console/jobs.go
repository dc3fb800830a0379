package console

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/redact"
)

// job is one replay or requeue running, or run, in this process.
type job struct {
	ID      string            `json:"id"`
	Action  string            `json:"action"`
	Sel     selection         `json:"selection"`
	Who     string            `json:"who"`
	AuditID int64             `json:"audit_id"`
	Started time.Time         `json:"started"`
	Dry     dryCounts         `json:"dry_run"`
	Result  dlq.RequeueResult `json:"result"`
	Done    bool              `json:"done"`
	Error   string            `json:"error,omitempty"`
	Outcome string            `json:"outcome"`
	mu      *sync.Mutex
}

type jobs struct {
	mu   sync.Mutex
	next int
	m    map[string]*job
	wg   sync.WaitGroup
}

func newJobs() *jobs { return &jobs{m: map[string]*job{}} }

func (js *jobs) add(j *job) {
	js.mu.Lock()
	defer js.mu.Unlock()
	js.next++
	j.ID = strconv.Itoa(js.next)
	j.mu = &sync.Mutex{}
	js.m[j.ID] = j
}

// snapshot returns a copy of the job, safe to render.
func (js *jobs) snapshot(id string) (job, bool) {
	js.mu.Lock()
	j, ok := js.m[id]
	js.mu.Unlock()
	if !ok {
		return job{}, false
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	c := *j
	c.mu = nil
	return c, true
}

// filterOf is the audit row's filter of sel: ids is null for a whole
// group.
func filterOf(sel selection) map[string]any {
	return map[string]any{"dlq": sel.DLQ, "fingerprint": sel.Fingerprint, "ids": sel.IDs}
}

// start runs an action in the background, recording it in the audit
// table before and after.
func (s *Server) start(who, action string, sel selection, dry dryCounts) (string, error) {
	ctx, cancel := context.WithTimeout(s.ctx, 30*time.Second)
	auditID, err := s.audit.start(ctx, who, action, sel.DLQ, filterOf(sel), dry)
	cancel()
	if err != nil {
		return "", err
	}
	j := &job{Action: action, Sel: sel, Who: who, AuditID: auditID, Started: time.Now(), Dry: dry, Outcome: "running"}
	s.jobs.add(j)
	s.jobs.wg.Add(1)
	go func() {
		defer s.jobs.wg.Done()
		res, err := s.requeue(s.ctx, action, sel, func(r dlq.RequeueResult) {
			j.mu.Lock()
			j.Result = r
			j.mu.Unlock()
		})
		outcome := "done"
		if err != nil {
			// Recorded and shown without any password of a URL.
			err = redact.Error(err, s.cfg.Secrets...)
			outcome = "failed"
		}
		fctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		ferr := s.audit.finish(fctx, auditID, res, outcome, err)
		cancel()
		if ferr != nil {
			s.log.Error("idemq console: record the result in the audit table", "audit_id", auditID, "err", ferr)
		}
		s.log.Info("idemq console: "+action+" finished", "who", who, "dlq", sel.DLQ, "fingerprint", sel.Fingerprint,
			"republished", res.Republished, "skipped", res.Skipped, "err", err)
		j.mu.Lock()
		j.Result, j.Done, j.Outcome = res, true, outcome
		if err != nil {
			j.Error = err.Error()
		}
		j.mu.Unlock()
	}()
	return j.ID, nil
}
