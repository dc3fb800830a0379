package console

import (
	"bytes"
	"embed"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var embedded embed.FS

var staticFS, _ = fs.Sub(embedded, "static")

var funcs = template.FuncMap{
	"when": func(t time.Time) string {
		if t.IsZero() {
			return "–"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"whenp": func(t *time.Time) string {
		if t == nil || t.IsZero() {
			return "–"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return age(time.Since(t)) + " ago"
	},
	"join": strings.Join,
	"orDash": func(s string) string {
		if s == "" {
			return "–"
		}
		return s
	},
	"derefi64": func(p *int64) string {
		if p == nil {
			return "–"
		}
		return fmt.Sprint(*p)
	},
	"add": func(a, b int) int { return a + b },
	"deref32": func(p *int32) string {
		if p == nil {
			return "–"
		}
		return fmt.Sprint(*p)
	},
	"deref": func(p *int) string {
		if p == nil {
			return "–"
		}
		return fmt.Sprint(*p)
	},
	"hex":      func(b []byte) string { return hex.EncodeToString(b) },
	"done":     done,
	"stepName": stepName,
}

// done counts the messages a replay settled, for its progress bar.
func done(r dlq.RequeueResult) int64 {
	return r.Republished + r.Skipped + r.Mismatched + r.BeyondHorizon + r.Unverified + r.MissingID + r.Truncated
}

// age renders a duration coarsely: 42s, 3m12s, 5h3m, 12d4h.
func age(d time.Duration) string {
	d = max(d, 0)
	switch {
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		return strings.TrimSuffix(d.Round(time.Minute).String(), "0s")
	}
	return fmt.Sprintf("%dd%dh", int64(d/(24*time.Hour)), int64(d%(24*time.Hour)/time.Hour))
}

var pages = map[string]*template.Template{}

func init() {
	names, _ := fs.Glob(templateFS, "templates/*.html")
	for _, n := range names {
		base := strings.TrimSuffix(strings.TrimPrefix(n, "templates/"), ".html")
		if base == "layout" || base == "chart" {
			continue
		}
		pages[base] = template.Must(template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/chart.html", n))
	}
}

// pageData is what every page's layout sees.
type pageData struct {
	Title    string
	Page     string
	CSRF     string
	User     string
	Mutable  bool
	ReadOnly bool
	// SignIn: the console has tokens, and every page needs a sign-in.
	SignIn bool
	Path   string
	Data   any
}

var titles = map[string]string{"overview": "Overview", "deadletters": "Dead letters", "group": "Dead-letter group",
	"dryrun": "Dry run", "job": "Replay", "audit": "Audit", "lookup": "Lookup", "login": "Sign in", "error": "Error", "consumer": "Consumer"}

func (s *Server) render(w http.ResponseWriter, r *http.Request, page string, data any) {
	s.renderStatus(w, r, http.StatusOK, page, data)
}

func (s *Server) renderStatus(w http.ResponseWriter, r *http.Request, code int, page string, data any) {
	sess := s.sessions.ensure(w, r)
	pd := pageData{Title: titles[page], Page: page, CSRF: sess.csrf, User: sess.user, Mutable: s.Mutable(),
		ReadOnly: s.cfg.ReadOnly, SignIn: s.signIn(), Path: r.URL.RequestURI(), Data: data}
	var buf bytes.Buffer
	if err := pages[page].Execute(&buf, pd); err != nil {
		s.log.Error("idemq console: render", "page", page, "err", err)
		http.Error(w, "internal error rendering the page", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write(buf.Bytes())
}

// fail renders an error page.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, code int, msg string) {
	s.renderStatus(w, r, code, "error", map[string]any{"Code": code, "Status": http.StatusText(code), "Message": msg})
}

// envelopeView is one dead letter, ready to render.
type envelopeView struct {
	Index     int
	Record    dlq.Record
	ParseErr  string
	Signature string
	Envelope  [][2]string
	Headers   [][2]string
	Timeline  []dlq.Entry
	BodyKind  string // "json", "text", "binary" or "empty"
	Body      string
	BodyBytes int
	Truncated bool
	ID        string
	Partition int32
	Offset    int64
	Timestamp time.Time
}

// maxBodyShown bounds the body bytes rendered.
const maxBodyShown = 64 << 10

func viewOf(e envelope) envelopeView {
	m := e.Msg
	v := envelopeView{Index: e.Index, Record: e.Record, ParseErr: e.ParseErr, Signature: e.Signature, Timeline: e.Timeline,
		ID: e.Record.MessageID, Partition: m.Partition, Offset: m.Offset, Timestamp: m.Timestamp, BodyBytes: len(m.Body)}
	keys := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		kv := [2]string{k, m.Headers[k]}
		if strings.HasPrefix(k, "x-idemq-") {
			v.Envelope = append(v.Envelope, kv)
		} else {
			v.Headers = append(v.Headers, kv)
		}
	}
	v.BodyKind, v.Body, v.Truncated = renderBody(m)
	return v
}

// renderBody shows a body as pretty JSON, text, or a hex dump.
func renderBody(m *consumer.Message) (kind, text string, truncated bool) {
	b := m.Body
	if len(b) == 0 {
		return "empty", "", false
	}
	if len(b) > maxBodyShown {
		b, truncated = b[:maxBodyShown], true
	}
	if !truncated && json.Valid(b) {
		var out bytes.Buffer
		if json.Indent(&out, b, "", "  ") == nil {
			return "json", out.String(), false
		}
	}
	if isText(b) {
		return "text", string(b), truncated
	}
	return "binary", hex.Dump(b), truncated
}

func isText(b []byte) bool {
	if !utf8.Valid(b) {
		return false
	}
	for _, r := range string(b) {
		if r < 0x20 && r != '\n' && r != '\r' && r != '\t' || r == 0x7f {
			return false
		}
	}
	return true
}
