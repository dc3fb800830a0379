package keys_test

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"testing"

	"github.com/idemq/idemq/keys"
)

func TestChildKeyDeterministicAndDistinct(t *testing.T) {
	a := keys.ChildKey("order-7", "charge-card/v1")
	if a != keys.ChildKey("order-7", "charge-card/v1") {
		t.Fatal("ChildKey is not deterministic")
	}
	if len(a) != 64 {
		t.Fatalf("len = %d, want 64 hex chars", len(a))
	}
	seen := map[string][2]string{}
	for _, c := range [][2]string{
		{"order-7", "charge-card/v1"},
		{"order-7", "charge-card/v2"},
		{"order-8", "charge-card/v1"},
		// Equal concatenations must not collide: the encoding is
		// length-prefixed.
		{"ab", "c/v1"},
		{"a", "bc/v1"},
		{"", "abc/v1"},
		{"abc/v1", ""},
	} {
		k := keys.ChildKey(c[0], c[1])
		if prev, ok := seen[k]; ok {
			t.Errorf("ChildKey(%q, %q) == ChildKey(%q, %q)", c[0], c[1], prev[0], prev[1])
		}
		seen[k] = c
	}
}

// TestChildKeyIsStable pins the encoding: a change would silently change
// every key derived in production, so downstream dedup would stop working
// across the upgrade.
func TestChildKeyIsStable(t *testing.T) {
	h := sha256.New()
	for _, p := range []string{"idemq.keys.ChildKey.v1", "order-7", "charge-card/v1"} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
	want := hex.EncodeToString(h.Sum(nil))
	if got := keys.ChildKey("order-7", "charge-card/v1"); got != want {
		t.Fatalf("ChildKey = %s, want %s", got, want)
	}
	// The literal guards against a change to both the code and the
	// reconstruction above.
	if want != "18a404c78ba0f8ca7036e1d4df500e4c24fdbc4ffc0585c361c6ca81ed4faa4e" {
		t.Fatalf("encoding changed: %s", want)
	}
}

func TestValidateStep(t *testing.T) {
	for _, ok := range []string{"charge-card/v1", "email/welcome/v2", "ship-line/sku-123/v10", "a.b_c-d/v1", "3ds/v1"} {
		if err := keys.ValidateStep(ok); err != nil {
			t.Errorf("ValidateStep(%q) = %v, want nil", ok, err)
		}
	}
	for _, bad := range []string{
		"", "charge-card", "charge-card/", "charge-card/v0", "charge-card/1", "charge-card/V1",
		"Charge-Card/v1", "items/3/v1", "0/v1", "/v1", "charge card/v1", "-x/v1", "x//v1",
		string(make([]byte, keys.MaxStepLen+1)),
	} {
		if err := keys.ValidateStep(bad); !errors.Is(err, keys.ErrInvalidStep) {
			t.Errorf("ValidateStep(%q) = %v, want ErrInvalidStep", bad, err)
		}
	}
}

func TestDerive(t *testing.T) {
	k, err := keys.Derive("order-7", "charge-card/v1")
	if err != nil || k != keys.ChildKey("order-7", "charge-card/v1") {
		t.Fatalf("Derive = %q, %v", k, err)
	}
	if _, err := keys.Derive("", "charge-card/v1"); !errors.Is(err, keys.ErrEmptyParent) {
		t.Errorf("empty parent: %v", err)
	}
	if _, err := keys.Derive("order-7", "step-list/2/v1"); !errors.Is(err, keys.ErrInvalidStep) {
		t.Errorf("positional step: %v", err)
	}
}
