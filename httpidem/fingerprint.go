package httpidem

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"net/http"
	"strings"
)

// Fingerprint returns the sha256 the middleware stores with a key for r with
// body: of its method, its path with its sorted query string, and its
// canonical body (Config.Canonicalize, or CanonicalJSON without
// Config.IgnoreFields). Each part is length-prefixed.
func (m *Middleware) Fingerprint(r *http.Request, body []byte) ([32]byte, error) {
	var (
		canon []byte
		err   error
	)
	if m.cfg.Canonicalize != nil {
		canon, err = m.cfg.Canonicalize(r, body)
	} else {
		canon, err = CanonicalJSON(body, m.cfg.IgnoreFields...)
	}
	if err != nil {
		return [32]byte{}, err
	}
	target := r.URL.Path
	if q := r.URL.Query(); len(q) > 0 {
		target += "?" + q.Encode() // sorted by key
	}
	h := sha256.New()
	var n [8]byte
	for _, part := range [][]byte{[]byte(r.Method), []byte(target), canon} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	var out [32]byte
	h.Sum(out[:0])
	return out, nil
}

// CanonicalJSON returns body re-encoded with object keys sorted and without
// insignificant whitespace, after deleting the fields named in drop (a
// top-level name, or a dotted path into nested objects such as
// "meta.request_time"). Numbers keep their exact text. A body that is not
// JSON (including an empty one) is returned unchanged.
func CanonicalJSON(body []byte, drop ...string) ([]byte, error) {
	if len(bytes.TrimSpace(body)) == 0 || !json.Valid(body) {
		return body, nil
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	for _, path := range drop {
		deletePath(v, strings.Split(path, "."))
	}
	return json.Marshal(v) // sorts map keys
}

func deletePath(v any, path []string) {
	obj, ok := v.(map[string]any)
	if !ok {
		return
	}
	if len(path) == 1 {
		delete(obj, path[0])
		return
	}
	deletePath(obj[path[0]], path[1:])
}
