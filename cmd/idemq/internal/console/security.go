package console

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// sessionCookie names the session cookie: HttpOnly, SameSite=Strict.
const sessionCookie = "idemq_console_session"

// sessionTTL is how long a session lives after its creation.
const sessionTTL = 12 * time.Hour

// maxSessions bounds the session table; the oldest are dropped beyond it.
const maxSessions = 10000

// session is one browser's: its CSRF token and, once signed in, the name of
// the token it signed in with.
type session struct {
	id      string
	csrf    string
	user    string
	created time.Time
}

type sessions struct {
	mu sync.Mutex
	m  map[string]*session
}

func newSessions() *sessions { return &sessions{m: map[string]*session{}} }

func randomToken() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}

func (ss *sessions) get(r *http.Request) *session {
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return nil
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	s := ss.m[c.Value]
	if s != nil && time.Since(s.created) > sessionTTL {
		delete(ss.m, c.Value)
		return nil
	}
	return s
}

// create makes a fresh session with a new id and CSRF token and sets its
// cookie.
func (ss *sessions) create(w http.ResponseWriter, r *http.Request, user string) *session {
	s := &session{id: randomToken(), csrf: randomToken(), user: user, created: time.Now()}
	ss.mu.Lock()
	if len(ss.m) >= maxSessions {
		var oldest *session
		for _, o := range ss.m {
			if oldest == nil || o.created.Before(oldest.created) {
				oldest = o
			}
		}
		delete(ss.m, oldest.id)
	}
	ss.m[s.id] = s
	ss.mu.Unlock()
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: s.id, Path: "/", HttpOnly: true,
		Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode, MaxAge: int(sessionTTL / time.Second)})
	return s
}

func (ss *sessions) drop(s *session) {
	ss.mu.Lock()
	delete(ss.m, s.id)
	ss.mu.Unlock()
}

// ensure returns the request's session, creating one if it has none.
func (ss *sessions) ensure(w http.ResponseWriter, r *http.Request) *session {
	if s := ss.get(r); s != nil {
		return s
	}
	return ss.create(w, r, "")
}

// sameOrigin checks a POST's Origin (or, lacking one, its Referer) against
// the host it was sent to, and the browser's Sec-Fetch-Site if it sent one.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
		return false
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		ref := r.Header.Get("Referer")
		if ref == "" {
			return false
		}
		u, err := url.Parse(ref)
		if err != nil {
			return false
		}
		origin = u.Scheme + "://" + u.Host
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	return origin == scheme+"://"+r.Host
}

func equal(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

// checkPost is the CSRF protection of every POST: same origin, a session,
// and the session's CSRF token in the form. It writes the refusal and
// returns nil if the request fails it.
func (s *Server) checkPost(w http.ResponseWriter, r *http.Request) *session {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		s.fail(w, r, http.StatusMethodNotAllowed, "use POST")
		return nil
	}
	if !sameOrigin(r) {
		s.fail(w, r, http.StatusForbidden, "cross-origin request refused (the Origin header must be this console's)")
		return nil
	}
	r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
	if err := r.ParseForm(); err != nil {
		s.fail(w, r, http.StatusBadRequest, "bad form")
		return nil
	}
	sess := s.sessions.get(r)
	if sess == nil || !equal(r.PostForm.Get("csrf"), sess.csrf) {
		s.fail(w, r, http.StatusForbidden, "missing or stale CSRF token: reload the page and try again")
		return nil
	}
	return sess
}

// checkMutation is checkPost plus: the console is not read-only, and the
// session signed in with a token.
func (s *Server) checkMutation(w http.ResponseWriter, r *http.Request) *session {
	if !s.Mutable() {
		s.fail(w, r, http.StatusForbidden, "the console is read-only")
		return nil
	}
	sess := s.checkPost(w, r)
	if sess == nil {
		return nil
	}
	if sess.user == "" {
		s.fail(w, r, http.StatusUnauthorized, "sign in with a token first")
		return nil
	}
	return sess
}

// tokenName returns the name of the token typed: its secret alone, or
// name:secret, the form it is configured in (IDEMQ_CONSOLE_TOKEN). Every
// token is compared, in constant time.
func (s *Server) tokenName(typed string) (string, bool) {
	name, ok := "", false
	for _, t := range s.cfg.Tokens {
		match := equal(typed, t.Secret)
		match = equal(typed, t.Name+":"+t.Secret) || match
		if match && !ok {
			name, ok = t.Name, true
		}
	}
	return name, ok
}

// signIn reports whether the console asks for a sign-in: it has tokens,
// and then may listen beyond loopback (see CheckAddr).
func (s *Server) signIn() bool { return len(s.cfg.Tokens) > 0 }

// public reports whether path is served to a session that has not signed
// in: the sign-in page, its static files and the health check.
func public(path string) bool {
	return path == "/login" || path == "/healthz" || path == "/favicon.ico" || strings.HasPrefix(path, "/static/")
}

// signedIn lets r through, or refuses it: with tokens, every page but the
// public ones needs a signed-in session. A GET goes to the sign-in page,
// which comes back to it; anything else is refused. It writes the refusal
// and returns false.
func (s *Server) signedIn(w http.ResponseWriter, r *http.Request) bool {
	if !s.signIn() || public(r.URL.Path) {
		return true
	}
	if sess := s.sessions.get(r); sess != nil && sess.user != "" {
		return true
	}
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		http.Redirect(w, r, "/login?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
		return false
	}
	s.fail(w, r, http.StatusUnauthorized, "sign in with a token first")
	return false
}

func (s *Server) handleLogin(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet {
		s.render(w, r, "login", map[string]any{"Next": safeNext(r.URL.Query().Get("next"))})
		return
	}
	if !s.signIn() {
		s.fail(w, r, http.StatusForbidden, "the console has no tokens: there is nothing to sign in for")
		return
	}
	sess := s.checkPost(w, r)
	if sess == nil {
		return
	}
	name, ok := s.tokenName(strings.TrimSpace(r.PostForm.Get("token")))
	if !ok {
		time.Sleep(300 * time.Millisecond) // slows guessing
		s.fail(w, r, http.StatusUnauthorized, "unknown token")
		return
	}
	// A new session id on sign-in: a session planted before it is not
	// signed in.
	s.sessions.drop(sess)
	s.sessions.create(w, r, name)
	http.Redirect(w, r, safeNext(r.PostForm.Get("next")), http.StatusSeeOther)
}

func (s *Server) handleLogout(w http.ResponseWriter, r *http.Request) {
	sess := s.checkPost(w, r)
	if sess == nil {
		return
	}
	s.sessions.drop(sess)
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// safeNext keeps a redirect target on this console: a path that resolves
// against this console's origin to the same origin. Browsers drop tabs and
// newlines from a URL and read a backslash as a slash, so any control
// character, space or backslash is refused first ("/\t/evil.example" is
// "//evil.example").
func safeNext(next string) string {
	if next == "" || strings.IndexFunc(next, func(c rune) bool { return c <= ' ' || c == 0x7f || c == '\\' }) >= 0 {
		return "/"
	}
	u, err := url.Parse(next)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil || !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") {
		return "/"
	}
	base := &url.URL{Scheme: "http", Host: "console.invalid", Path: "/"}
	if r := base.ResolveReference(u); r.Scheme != base.Scheme || r.Host != base.Host {
		return "/"
	}
	return next
}
