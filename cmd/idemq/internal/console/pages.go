package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/cmd/idemq/internal/reconcile"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

// pageTimeout bounds the work of one page.
const pageTimeout = 60 * time.Second

func (s *Server) routes() {
	m := http.NewServeMux()
	m.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(staticFS)))
	m.HandleFunc("GET /{$}", s.handleOverview)
	m.HandleFunc("GET /dead-letters", s.handleDeadLetters)
	m.HandleFunc("GET /group", s.handleGroup)
	m.HandleFunc("GET /dry-run", s.handleDryRun)
	m.HandleFunc("/actions", s.handleAction)
	m.HandleFunc("GET /jobs/{id}", s.handleJob)
	m.HandleFunc("GET /audit", s.handleAudit)
	m.HandleFunc("GET /lookup", s.handleLookup)
	m.HandleFunc("GET /consumer", s.handleConsumer)
	m.HandleFunc("/login", s.handleLogin)
	m.HandleFunc("/logout", s.handleLogout)
	m.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	m.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { s.fail(w, r, http.StatusNotFound, "no such page") })
	s.mux = m
}

// clean makes an error safe to show: no password of a configured URL.
func (s *Server) clean(err error) string {
	if err == nil {
		return ""
	}
	return redact.Error(err, s.cfg.Secrets...).Error()
}

func (s *Server) cleanAll(errs []error) []string {
	var out []string
	for _, e := range errs {
		out = append(out, s.clean(e))
	}
	return out
}

// overview is the overview page's data.
type overview struct {
	Consumers   []ConsumerStatus
	ConsumerErr string
	Retention   time.Duration
	DLQs        []dlqStatus
	Outbox      *outbox.Stats
	OutboxName  string
	OutboxErr   string
	HTTPKeys    *httpKeyStats
	HTTPName    string
	HTTPErr     string
	Info        [][2]string
	// Recon is the last reconciliation, if Config.Reconciliation is set.
	Recon *reconView
	// Charts are the activity charts: applied messages, duplicates
	// skipped, dead letters by group, the outbox backlog.
	Charts []chartPair
	// ChartErr says why there are no charts: the database's clock could
	// not be read.
	ChartErr string
}

// reconView is the overview's card of the last reconciliation.
type reconView struct {
	File   string
	Report *reconcile.Report
	Kinds  []reconKind
	Error  string
}

// reconKind is one kind of discrepancy, with its first samples.
type reconKind struct {
	reconcile.KindInfo
	Samples []reconcile.Sample
}

// reconSamples is how many samples of each kind the overview shows.
const reconSamples = 3

// reconciliation reads the last report the file holds.
func (s *Server) reconciliation() *reconView {
	v := &reconView{File: s.cfg.Reconciliation}
	b, err := os.ReadFile(s.cfg.Reconciliation)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			v.Error = "no reconciliation yet: run 'idemq reconcile --out " + s.cfg.Reconciliation + "'"
		} else {
			v.Error = s.clean(err)
		}
		return v
	}
	var rep reconcile.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		v.Error = "the file does not hold a report of 'idemq reconcile --json': " + s.clean(err)
		return v
	}
	v.Report = &rep
	for _, k := range rep.Kinds() {
		rk := reconKind{KindInfo: k}
		rk.Samples = k.Kind.Samples[:min(len(k.Kind.Samples), reconSamples)]
		v.Kinds = append(v.Kinds, rk)
	}
	return v
}

type dlqStatus struct {
	DLQ
	Depth     *int64
	Oldest    time.Time
	Groups    int
	Error     string
	DeadLinks string
}

type httpKeyStats struct{ Rows, InProgress, Completed int64 }

// consumers lists Config.Consumers and the consumers with rows in the
// dedup table (in any shard's).
func (s *Server) consumers(ctx context.Context) ([]string, error) {
	out := slices.Clone(s.cfg.Consumers)
	for i, sh := range s.shards {
		rows, err := sh.DB.Query(ctx, consumersSQL(pgx.Identifier{sh.Store.Schema(), sh.Store.Table()}.Sanitize()))
		if pgmigrate.IsUndefined(err) {
			err = fmt.Errorf("the dedup table %s does not exist: run 'idemq migrate' (or give --schema and --table)", sh.Store)
		}
		var names []string
		if err == nil {
			names, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		if err != nil {
			return out, s.onShard(i, err)
		}
		for _, n := range names {
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	return out, nil
}

// onShard says which shard err is from, with Config.Shards.
func (s *Server) onShard(i int, err error) error {
	if len(s.cfg.Shards) == 0 {
		return err
	}
	return fmt.Errorf("shard %d: %w", i, err)
}

// consumersSQL lists the first 200 consumers with rows in table, by name.
// A DISTINCT would read every row's entry in the primary key; this skips
// from one consumer to the next through it, one probe per consumer.
func consumersSQL(table string) string {
	return `WITH RECURSIVE c(consumer) AS (
	(SELECT consumer FROM ` + table + ` ORDER BY consumer LIMIT 1)
	UNION ALL
	SELECT (SELECT t.consumer FROM ` + table + ` AS t WHERE t.consumer > c.consumer ORDER BY t.consumer LIMIT 1)
	FROM c WHERE c.consumer IS NOT NULL)
SELECT consumer FROM c WHERE consumer IS NOT NULL LIMIT 200`
}

// consumerStatus is a consumer's overview row: with Config.Shards, each
// shard's and their total.
func (s *Server) consumerStatus(ctx context.Context, name string) (ConsumerStatus, error) {
	read := func(sh Shard) (ConsumerStatus, error) {
		if s.cfg.Status != nil {
			return s.cfg.Status(ctx, sh, name)
		}
		st, err := sh.Store.Stats(ctx, name)
		return ConsumerStatus{Consumer: name, Rows: st.Rows, Oldest: st.Oldest}, err
	}
	if len(s.cfg.Shards) == 0 {
		return read(s.shards[0])
	}
	total := ConsumerStatus{Consumer: name}
	for i, sh := range s.shards {
		st, err := read(sh)
		if err != nil {
			return total, s.onShard(i, err)
		}
		total.Shards = append(total.Shards, st)
		total.Rows += st.Rows
		if !st.Oldest.IsZero() && (total.Oldest.IsZero() || st.Oldest.Before(total.Oldest)) {
			total.Oldest = st.Oldest
		}
		if st.PurgeEligible != nil && (i == 0 || total.PurgeEligible != nil) {
			n := *st.PurgeEligible
			if total.PurgeEligible != nil {
				n += *total.PurgeEligible
			}
			total.PurgeEligible = &n
		} else {
			total.PurgeEligible = nil
		}
		if l := st.LastApplied; l != nil && (total.LastApplied == nil || l.ProcessedAt.After(total.LastApplied.ProcessedAt)) {
			total.LastApplied = l
		}
	}
	return total, nil
}

func (s *Server) handleOverview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	ov := overview{Retention: s.cfg.Retention, Info: s.cfg.Info}
	names, err := s.consumers(ctx)
	if err != nil {
		ov.ConsumerErr = s.clean(err)
	}
	for _, n := range names {
		st, err := s.consumerStatus(ctx, n)
		if err != nil {
			ov.ConsumerErr = s.clean(err)
			continue
		}
		ov.Consumers = append(ov.Consumers, st)
	}
	now, closed, clockErr := s.clock(ctx)
	if clockErr == nil {
		ov.Charts = s.activity(ctx, sorted(names), now, closed)
	}
	times := newDeadLetterTimes()
	var (
		allGroups []groupRow
		dlqErrs   []string
	)
	for _, q := range s.cfg.DLQs {
		d := dlqStatus{DLQ: q, DeadLinks: "/dead-letters?" + url.Values{"dlq": {q.ID()}}.Encode()}
		if q.Depth != nil {
			if n, err := q.Depth(ctx); err != nil {
				d.Error = s.clean(err)
			} else {
				d.Depth = &n
			}
		}
		groups, errs := s.inspectTimes(ctx, q.ID(), dlq.Filter{}, times)
		if len(errs) > 0 {
			d.Error = strings.Join(s.cleanAll(errs), "; ")
			dlqErrs = append(dlqErrs, d.Error)
		}
		allGroups = append(allGroups, groups...)
		d.Groups = len(groups)
		for _, g := range groups {
			if !g.FirstSeen.IsZero() && (d.Oldest.IsZero() || g.FirstSeen.Before(d.Oldest)) {
				d.Oldest = g.FirstSeen
			}
		}
		ov.DLQs = append(ov.DLQs, d)
	}
	if clockErr == nil && len(s.cfg.DLQs) > 0 {
		hw, dw := windowsAt(now)
		ov.Charts = append(ov.Charts, pair(deadLetterCharts(times, allGroups, dlqErrs, hw, dw, s.cfg.ScanLimit)))
	}
	if t := s.cfg.Outbox; t.Name != "" {
		ov.OutboxName = t.Schema + "." + t.Name
		ob, err := outbox.New(s.cfg.DB, outbox.Config{Schema: t.Schema, Table: t.Name})
		if err == nil {
			var st outbox.Stats
			if st, err = ob.Stats(ctx); err == nil {
				ov.Outbox = &st
				if clockErr == nil {
					ov.Charts = append(ov.Charts, s.backlog(ctx, t, st.Pending, now))
				}
			}
		}
		if err != nil && !errors.Is(err, consumer.ErrNotMigrated) {
			ov.OutboxErr = s.clean(err)
		}
	}
	if t := s.cfg.HTTPKeys; t.Name != "" {
		ov.HTTPName = t.Schema + "." + t.Name
		var exists bool
		tbl := pgx.Identifier{t.Schema, t.Name}.Sanitize()
		err := s.cfg.DB.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, tbl).Scan(&exists)
		if err == nil && exists {
			var st httpKeyStats
			err = s.cfg.DB.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE state = 'in_progress'), count(*) FILTER (WHERE state = 'completed') FROM `+tbl).
				Scan(&st.Rows, &st.InProgress, &st.Completed)
			if err == nil {
				ov.HTTPKeys = &st
			}
		}
		if err != nil {
			ov.HTTPErr = s.clean(err)
		}
	}
	if s.cfg.Reconciliation != "" {
		ov.Recon = s.reconciliation()
	}
	if clockErr != nil {
		ov.ChartErr = s.clean(clockErr)
	}
	s.render(w, r, "overview", ov)
}

// consumerView is a consumer's page.
type consumerView struct {
	Name      string
	Status    *ConsumerStatus
	Err       string
	Retention time.Duration
	Charts    []chartPair
	ChartErr  string
}

// handleConsumer is a consumer's page: its overview row, and its charts
// (applied messages, duplicates skipped, its dead letters by group).
func (s *Server) handleConsumer(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	name := strings.TrimSpace(r.URL.Query().Get("name"))
	if name == "" {
		s.fail(w, r, http.StatusBadRequest, "name a consumer: /consumer?name=…")
		return
	}
	v := consumerView{Name: name, Retention: s.cfg.Retention}
	if st, err := s.consumerStatus(ctx, name); err != nil {
		v.Err = s.clean(err)
	} else {
		v.Status = &st
	}
	now, closed, err := s.clock(ctx)
	if err != nil {
		v.ChartErr = s.clean(err)
		s.render(w, r, "consumer", v)
		return
	}
	v.Charts = s.activity(ctx, []string{name}, now, closed)
	if len(s.cfg.DLQs) > 0 {
		times := newDeadLetterTimes()
		groups, errs := s.inspectTimes(ctx, "", dlq.Filter{Consumer: name}, times)
		hw, dw := windowsAt(now)
		v.Charts = append(v.Charts, pair(deadLetterCharts(times, groups, s.cleanAll(errs), hw, dw, s.cfg.ScanLimit)))
	}
	s.render(w, r, "consumer", v)
}

// filterForm is the dead-letters page's filter.
type filterForm struct {
	DLQ, Consumer, Class, Source, Since, Until string
}

func (s *Server) handleDeadLetters(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	q := r.URL.Query()
	ff := filterForm{DLQ: q.Get("dlq"), Consumer: q.Get("consumer"), Class: q.Get("class"), Source: q.Get("source"), Since: q.Get("since"), Until: q.Get("until")}
	f := dlq.Filter{Consumer: ff.Consumer}
	if ff.Class != "" {
		f.Classes = []consumer.FailureClass{consumer.FailureClass(ff.Class)}
	}
	if ff.Source != "" {
		f.Sources = []string{ff.Source}
	}
	var errs []string
	now := time.Now()
	var err error
	if f.Since, err = parseWhen(ff.Since, now); err != nil {
		errs = append(errs, "since: "+err.Error())
	}
	if f.Until, err = parseWhen(ff.Until, now); err != nil {
		errs = append(errs, "until: "+err.Error())
	}
	if ff.DLQ != "" {
		if _, ok := s.dlqs[ff.DLQ]; !ok {
			s.fail(w, r, http.StatusNotFound, "no such dead-letter queue")
			return
		}
	}
	var groups []groupRow
	if len(errs) == 0 {
		var ierrs []error
		groups, ierrs = s.inspect(ctx, ff.DLQ, f)
		errs = append(errs, s.cleanAll(ierrs)...)
	}
	type row struct {
		groupRow
		Link, DryRun string
	}
	var rows []row
	total := 0
	for _, g := range groups {
		v := url.Values{"dlq": {g.DLQ.ID()}, "fp": {g.Fingerprint}}
		rows = append(rows, row{groupRow: g, Link: "/group?" + v.Encode(), DryRun: "/dry-run?" + v.Encode()})
		total += g.Count
	}
	s.render(w, r, "deadletters", map[string]any{"Filter": ff, "Groups": rows, "Total": total, "Errors": errs,
		"DLQs": s.cfg.DLQs, "Classes": classes, "Verify": len(s.cfg.VerifyKeys) > 0})
}

var classes = []consumer.FailureClass{consumer.ClassRetryableExhausted, consumer.ClassPermanent, consumer.ClassPanic,
	consumer.ClassMissingID, consumer.ClassFingerprintMismatch, consumer.ClassTooLarge, consumer.ClassTimeout, consumer.ClassBroker}

// selectionOf reads a selection from a query or a form.
func (s *Server) selectionOf(v url.Values) (selection, error) {
	sel := selection{DLQ: v.Get("dlq"), Fingerprint: v.Get("fp")}
	if _, ok := s.dlqs[sel.DLQ]; !ok {
		return sel, errors.New("no such dead-letter queue")
	}
	if len(sel.Fingerprint) != 16 || strings.Trim(sel.Fingerprint, "0123456789abcdef") != "" {
		return sel, errors.New("fp must be a failure fingerprint: 16 hex digits")
	}
	for _, id := range v["id"] {
		if id = strings.TrimSpace(id); id != "" && !slices.Contains(sel.IDs, id) {
			sel.IDs = append(sel.IDs, id)
		}
	}
	return sel, nil
}

func (sel selection) query() url.Values {
	v := url.Values{"dlq": {sel.DLQ}, "fp": {sel.Fingerprint}}
	if len(sel.IDs) > 0 {
		v["id"] = sel.IDs
	}
	return v
}

func (s *Server) handleGroup(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	sel, err := s.selectionOf(r.URL.Query())
	if err != nil {
		s.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	page, _ := strconv.Atoi(r.URL.Query().Get("page"))
	page = max(page, 1)
	items, total, err := s.groupPage(ctx, sel, page)
	pages := max((total+s.cfg.PageSize-1)/s.cfg.PageSize, 1)
	var views []envelopeView
	for _, e := range items {
		views = append(views, viewOf(e))
	}
	link := func(p int) string {
		v := sel.query()
		v.Set("page", strconv.Itoa(p))
		return "/group?" + v.Encode()
	}
	data := map[string]any{"Sel": sel, "DLQ": s.dlqs[sel.DLQ], "Items": views, "Total": total, "Page": page, "Pages": pages,
		"Error": s.clean(err), "Verify": len(s.cfg.VerifyKeys) > 0, "DryRun": "/dry-run?" + sel.query().Encode()}
	if page > 1 {
		data["Prev"] = link(page - 1)
	}
	if page < pages {
		data["Next"] = link(page + 1)
	}
	s.render(w, r, "group", data)
}

// dryRunView is the dry-run page's data, and the confirmation.
type dryRunView struct {
	Sel     selection
	DLQ     DLQ
	Counts  dryCounts
	Tiles   []tile
	Confirm string
	Items   []dlq.Item
	Scanned int
	Error   string
	Back    string
}

func (c dryCounts) confirm() string {
	return fmt.Sprintf("%d/%d/%d/%d/%d/%d/%d/%d", c.Selected, c.WillApply, c.AlreadyApplied, c.Mismatch, c.BeyondHorizon, c.Unverified, c.MissingID, c.Truncated)
}

func (s *Server) handleDryRun(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	sel, err := s.selectionOf(r.URL.Query())
	if err != nil {
		s.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	cl, err := s.classify(ctx, sel)
	c := countsOf(cl)
	s.render(w, r, "dryrun", dryRunView{Sel: sel, DLQ: s.dlqs[sel.DLQ], Counts: c, Tiles: c.tiles(), Confirm: c.confirm(), Items: cl.Items,
		Scanned: cl.Scanned, Error: s.clean(err), Back: "/group?" + (selection{DLQ: sel.DLQ, Fingerprint: sel.Fingerprint}).query().Encode()})
}

func (s *Server) handleAction(w http.ResponseWriter, r *http.Request) {
	sess := s.checkMutation(w, r)
	if sess == nil {
		return
	}
	action := r.PostForm.Get("action")
	if action != "replay" && action != "requeue" {
		s.fail(w, r, http.StatusBadRequest, "action must be replay or requeue")
		return
	}
	sel, err := s.selectionOf(r.PostForm)
	if err != nil {
		s.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	// The dry run again, now: the operator confirmed these counts, and
	// the action runs only if the queue still gives them.
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	cl, err := s.classify(ctx, sel)
	if err != nil {
		s.fail(w, r, http.StatusBadGateway, "dry run: "+s.clean(err))
		return
	}
	c := countsOf(cl)
	if got := r.PostForm.Get("confirm"); got != c.confirm() {
		s.fail(w, r, http.StatusConflict, "the dead letters changed since the dry run you confirmed: run the dry run again")
		return
	}
	if c.Selected == 0 {
		s.fail(w, r, http.StatusConflict, "nothing selected")
		return
	}
	id, err := s.start(sess.user, action, sel, c)
	if err != nil {
		s.fail(w, r, http.StatusInternalServerError, s.clean(err))
		return
	}
	http.Redirect(w, r, "/jobs/"+id, http.StatusSeeOther)
}

func (s *Server) handleJob(w http.ResponseWriter, r *http.Request) {
	j, ok := s.jobs.snapshot(r.PathValue("id"))
	if !ok {
		s.fail(w, r, http.StatusNotFound, "no such job (jobs are kept until the console restarts; see the audit log)")
		return
	}
	j.Error = redact.Error(errors.New(j.Error), s.cfg.Secrets...).Error()
	if r.URL.Query().Get("format") == "json" {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(j)
		return
	}
	s.render(w, r, "job", map[string]any{"Job": j, "DLQ": s.dlqs[j.Sel.DLQ],
		"Back": "/group?" + (selection{DLQ: j.Sel.DLQ, Fingerprint: j.Sel.Fingerprint}).query().Encode()})
}

func (s *Server) handleAudit(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	rows, err := s.audit.list(ctx, 200)
	s.render(w, r, "audit", map[string]any{"Rows": rows, "Error": s.clean(err), "Table": s.audit.table()})
}

// lookupView is the lookup page's data.
type lookupView struct {
	Consumer, ID string
	Consumers    []string
	Searched     bool
	Row          *processed.Row
	NotFound     bool
	Copies       []groupRow
	Error        string

	Scope, Key  string
	KeySearched bool
	KeyRow      *httpKeyRow
	KeyNotFound bool
	KeyError    string
	HTTPTable   string
}

type httpKeyRow struct {
	State, Method, Path string
	Status              *int
	CreatedAt           time.Time
	CompletedAt         *time.Time
}

func (s *Server) handleLookup(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	q := r.URL.Query()
	v := lookupView{Consumer: strings.TrimSpace(q.Get("consumer")), ID: strings.TrimSpace(q.Get("id")),
		Scope: q.Get("scope"), Key: strings.TrimSpace(q.Get("key"))}
	v.Consumers, _ = s.consumers(ctx)
	if v.Consumer != "" && v.ID != "" {
		v.Searched = true
		row, err := s.lookup.Lookup(ctx, v.Consumer, v.ID)
		switch {
		case errors.Is(err, processed.ErrNotFound):
			v.NotFound = true
		case err != nil:
			v.Error = s.clean(err)
		default:
			v.Row = &row
		}
		copies, errs := s.inspect(ctx, "", dlq.Filter{Consumer: v.Consumer, MessageIDs: []string{v.ID}})
		v.Copies = copies
		if len(errs) > 0 {
			v.Error = strings.TrimPrefix(v.Error+"; "+strings.Join(s.cleanAll(errs), "; "), "; ")
		}
	}
	if t := s.cfg.HTTPKeys; t.Name != "" {
		v.HTTPTable = t.Schema + "." + t.Name
		if v.Key != "" {
			v.KeySearched = true
			var k httpKeyRow
			err := s.cfg.DB.QueryRow(ctx, `SELECT state, method, path, status, created_at, completed_at FROM `+pgx.Identifier{t.Schema, t.Name}.Sanitize()+
				` WHERE scope = $1 AND key = $2`, v.Scope, v.Key).Scan(&k.State, &k.Method, &k.Path, &k.Status, &k.CreatedAt, &k.CompletedAt)
			switch {
			case errors.Is(err, pgx.ErrNoRows):
				v.KeyNotFound = true
			case err != nil:
				v.KeyError = s.clean(err)
			default:
				v.KeyRow = &k
			}
		}
	}
	s.render(w, r, "lookup", v)
}
