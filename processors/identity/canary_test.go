package identity

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/token"
)

// TestCanaryPrivateKeyNeverLeaks takes the dev issuer's private "d" as the
// canary and drives every path that handles the key file or reports on
// it: loading broken and misplaced key files, pointing the verifier's JWKS
// source (file and URL) at the private key, refreshing from it, every
// rejection, and printing or logging every type involved. The canary must
// appear in no error, log line or formatted value.
func TestCanaryPrivateKeyNeverLeaks(t *testing.T) {
	t.Parallel()
	iss, keyPath := newIssuer(t)
	keyFile, err := os.ReadFile(keyPath)
	if err != nil {
		t.Fatal(err)
	}
	var jwk map[string]string
	if err := json.Unmarshal(keyFile, &jwk); err != nil {
		t.Fatal(err)
	}
	canary := jwk["d"]
	if len(canary) < 40 {
		t.Fatalf("private jwk d = %d chars; want a 32-byte key", len(canary))
	}
	// Pieces of the canary too: a leak may quote part of a value.
	needles := []string{canary, canary[:16], canary[16:32], canary[len(canary)-16:]}

	var logs bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	textLogger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var outputs []string
	record := func(err error) {
		if err != nil {
			outputs = append(outputs, err.Error(), fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", err))
		}
	}
	dir := t.TempDir()
	writePrivate := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}

	// Broken or misplaced key files.
	for name, content := range map[string]string{
		"truncated":        string(keyFile[:len(keyFile)-3]),
		"d corrupted":      strings.Replace(string(keyFile), canary, canary[:20]+"!"+canary[21:], 1),
		"d too short":      strings.Replace(string(keyFile), canary, canary[:30], 1),
		"control char":     strings.Replace(string(keyFile), canary, canary[:20]+"\x01"+canary[20:], 1),
		"garbage appended": string(keyFile) + canary,
		"wrong alg":        strings.Replace(string(keyFile), `"EdDSA"`, `"ES256"`, 1),
	} {
		_, err := LoadOrCreateIssuer(writePrivate(name, content), testIssuer)
		if err == nil {
			t.Errorf("LoadOrCreateIssuer(%s) error = nil; want an error", name)
		}
		record(err)
	}
	loose := writePrivate("loose", string(keyFile))
	if err := os.Chmod(loose, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = LoadOrCreateIssuer(loose, testIssuer)
	record(err)

	// The verifier pointed at the private key, as a file and as a URL.
	_, err = New(t.Context(), Config{Issuer: testIssuer, JWKSFile: keyPath, Logger: logger})
	record(err)
	asJWKS := `{"keys":[` + string(keyFile) + `]}`
	_, err = New(t.Context(), Config{Issuer: testIssuer, JWKSFile: writePrivate("jwks-with-d.json", asJWKS), Logger: logger})
	record(err)
	set := iss.Keys()
	srv := newJWKSServer(t, set)
	srv.set([]byte(asJWKS))
	_, err = New(t.Context(), Config{Issuer: testIssuer, JWKSURL: srv.URL + "/jwks?secret=" + canary, Logger: logger})
	record(err)
	srv.status.Store(http.StatusTeapot)
	_, err = New(t.Context(), Config{Issuer: testIssuer, JWKSURL: srv.URL + "/jwks?secret=" + canary, Logger: logger})
	record(err)
	srv.status.Store(http.StatusOK)

	// Refreshes that fail on the private key, logged as warnings.
	clk := newClock()
	srv.set(set.JWKS())
	jwksPath := filepath.Join(dir, "jwks.json")
	if err := os.WriteFile(jwksPath, set.JWKS(), 0o644); err != nil {
		t.Fatal(err)
	}
	var verifiers []*Verifier
	for _, cfg := range []Config{
		{Issuer: testIssuer, JWKSFile: jwksPath, Now: clk.Now, Logger: logger},
		{Issuer: testIssuer, JWKSURL: srv.URL + "/jwks?secret=" + canary, Now: clk.Now, Logger: textLogger},
	} {
		v, err := New(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		verifiers = append(verifiers, v)
	}
	if err := os.WriteFile(jwksPath, []byte(asJWKS), 0o644); err != nil {
		t.Fatal(err)
	}
	srv.set([]byte(asJWKS))
	clk.Advance(DefaultRefresh)
	tok, err := iss.Mint(testIdentity, "", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range verifiers {
		id, err := v.Verify(t.Context(), tok)
		if err != nil {
			t.Fatalf("Verify() after a failed refresh = %v; want the old keys kept", err)
		}
		outputs = append(outputs, fmt.Sprintf("%+v", id))
		// And a rejection of each kind that involves the key.
		for _, bad := range []string{"", "x", tok + "x", strings.Replace(tok, ".", "..", 1), tok[:len(tok)/2]} {
			_, err := v.Verify(t.Context(), bad)
			record(err)
		}
	}
	if got := strings.Count(logs.String(), "jwks refresh failed"); got != 2 {
		t.Errorf("logged %d refresh warnings; want 2 (the canary check needs them):\n%s", got, logs.String())
	}

	// Every type, every verb, every logger.
	key, err := token.ParsePrivateJWK(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	values := []any{iss, *iss, key, &key, set, verifiers[0], struct {
		i *Issuer
		k token.Key
	}{iss, key}}
	for _, v := range values {
		for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%d"} {
			outputs = append(outputs, fmt.Sprintf(verb, v))
		}
		logger.Info("value", "v", v)
		textLogger.Info("value", "v", v)
	}
	outputs = append(outputs, logs.String())

	for _, out := range outputs {
		for _, n := range needles {
			if strings.Contains(out, n) {
				t.Fatalf("canary %q leaked in %q", n, out)
			}
		}
	}
	if strings.Contains(tok, canary) || strings.Contains(string(set.JWKS()), canary) {
		t.Error("the canary leaked into a minted token or the public JWKS")
	}
}
