package credentials

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// canarySeed is the signing key's seed in TestNoSecretLeaks: if it shows
// up anywhere, in any encoding, a private key leaked.
var canarySeed = []byte("CANARY-signing-key-seed-32bytes!")

// secretForms returns every encoding under which secret could leak.
func secretForms(name string, secret []byte) map[string]string {
	forms := map[string]string{
		name + " raw":       string(secret),
		name + " base64url": base64.RawURLEncoding.EncodeToString(secret),
		name + " base64":    base64.StdEncoding.EncodeToString(secret),
		name + " hex":       hex.EncodeToString(secret),
		name + " HEX":       strings.ToUpper(hex.EncodeToString(secret)),
		// fmt's %v of a []byte: "[67 65 78 ...".
		name + " decimal": strings.Trim(fmt.Sprint(secret[:8]), "[]"),
	}
	return forms
}

func TestNoSecretLeaks(t *testing.T) {
	t.Parallel()
	if len(canarySeed) != ed25519.SeedSize {
		t.Fatalf("canary seed is %d bytes; want %d", len(canarySeed), ed25519.SeedSize)
	}
	c := newClock()
	dir := t.TempDir()
	priv := ed25519.NewKeyFromSeed(canarySeed)
	kid := thumbprint(priv.Public().(ed25519.PublicKey))
	kf, err := json.Marshal(keyFile{Kid: kid, Created: t0, Seed: b64.EncodeToString(canarySeed)})
	must(t, err)
	must(t, os.WriteFile(filepath.Join(dir, kid+".json"), kf, 0o600))

	var out bytes.Buffer // everything any output path produced
	logger := slog.New(slog.NewJSONHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))
	textLogger := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))
	b := newBroker(t, c, Config{KeyDir: dir, RotateEvery: time.Hour, Logger: logger})
	if b.current.kid != kid {
		t.Fatalf("broker signs with %s; want the canary key %s", b.current.kid, kid)
	}
	v := newVerifier(t, c, b, VerifierConfig{Logger: logger})
	cred := mint(t, b, grant())

	forms := secretForms("signing key", canarySeed)
	for k, s := range secretForms("private key", priv) {
		forms[k] = s
	}
	forms["token"] = cred.Token
	forms["token signature"] = cred.Token[strings.LastIndexByte(cred.Token, '.')+1:]

	// fmt, every verb, directly, by pointer and nested.
	type holder struct {
		Cred   Credential
		Broker *Broker
	}
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%X", "%d", "%T"} {
		fmt.Fprintf(&out, verb+"\n", cred)
		fmt.Fprintf(&out, verb+"\n", &cred)
		fmt.Fprintf(&out, verb+"\n", holder{Cred: cred, Broker: b})
		fmt.Fprintf(&out, verb+"\n", []Credential{cred})
		fmt.Fprintf(&out, verb+"\n", map[string]Credential{"c": cred})
		fmt.Fprintf(&out, verb+"\n", b)
	}
	out.WriteString(fmt.Sprint(cred, b) + fmt.Sprintln(cred, b))

	// encoding/json and slog, both handlers.
	for _, v := range []any{cred, &cred, holder{Cred: cred}} {
		j, err := json.Marshal(v)
		must(t, err)
		out.Write(j)
	}
	for _, l := range []*slog.Logger{logger, textLogger} {
		l.Info("credential", "cred", cred, "holder", holder{Cred: cred, Broker: b}, "broker", b)
		l.Info("credential", slog.Any("cred", &cred))
	}

	// Logs of the broker's lifecycle: mint, rotation, restart.
	c.Advance(time.Hour)
	cred2 := mint(t, b, grant())
	forms["rotated token"] = cred2.Token
	if _, err := New(Config{KeyDir: dir, Now: c.Now, Logger: logger}); err != nil {
		t.Fatal(err)
	}
	out.Write(b.JWKS())

	// Errors of every refusal of a real token, and of Mint.
	other := Expect{Scope: "tool::send_email", Tenant: "t_other", IdempotencyKey: "other"}
	presentations := []struct {
		token string
		want  Expect
	}{
		{cred.Token, expect()},
		{cred.Token, other},                     // replayed
		{cred2.Token, other},                    // wrong scope
		{cred.Token + "x", expect()},            // bad base64 signature
		{cred.Token[:len(cred.Token)-4], other}, // short signature
		{cred.Token + ".x", expect()},           // four segments
		{strings.Replace(cred.Token, ".", "=.", 1), expect()},
		{strings.Repeat(cred.Token, MaxTokenBytes/len(cred.Token)+1), expect()},
	}
	for _, p := range presentations {
		if _, err := v.Verify(context.Background(), p.token, p.want); err != nil {
			fmt.Fprintf(&out, "%v\n%+v\n%#v\n", err, err, err)
		}
	}
	c.Advance(time.Hour)
	if _, err := v.Verify(context.Background(), cred2.Token, expect()); err != nil {
		fmt.Fprintf(&out, "%v\n", err) // expired
	}
	g := grant()
	g.Deadline = t0
	if _, err := b.Mint(g); err != nil {
		fmt.Fprintf(&out, "%v\n", err)
	}

	// Errors about key files quote no key bytes.
	bad := t.TempDir()
	kf, err = json.Marshal(keyFile{Kid: "wrong", Created: t0, Seed: b64.EncodeToString(canarySeed)})
	must(t, err)
	must(t, os.WriteFile(filepath.Join(bad, "wrong.json"), kf, 0o600))
	if _, err := New(Config{KeyDir: bad, Logger: logger}); err == nil {
		t.Errorf("New over a key file whose kid does not match: no error")
	} else {
		fmt.Fprintf(&out, "%v\n", err)
	}
	must(t, os.WriteFile(filepath.Join(bad, "wrong.json"), append([]byte("{"), canarySeed...), 0o600))
	if _, err := New(Config{KeyDir: bad, Logger: logger}); err == nil {
		t.Errorf("New over a corrupt key file: no error")
	} else {
		fmt.Fprintf(&out, "%v\n", err)
	}

	got := out.String()
	if !strings.Contains(got, cred.JTI) || !strings.Contains(got, "[redacted]") {
		t.Fatalf("output lacks the jti or the redaction marker; the test printed nothing useful:\n%s", got)
	}
	for name, secret := range forms {
		if i := strings.Index(got, secret); i >= 0 {
			lo, hi := max(0, i-80), min(len(got), i+len(secret)+80)
			t.Errorf("output contains the %s: ...%s...", name, got[lo:hi])
		}
	}
}

func TestCredentialString(t *testing.T) {
	t.Parallel()
	cred := Credential{Token: "tok.en.secret", JTI: "j1", Family: "refund_order:t_acme:4", Scope: "tool::refund_order", ExpiresAt: t0}
	want := `credentials.Credential{JTI:"j1" Family:"refund_order:t_acme:4" Scope:"tool::refund_order" ExpiresAt:2026-01-02T03:04:05Z Token:[redacted]}`
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%x"} {
		if got := fmt.Sprintf(verb, cred); got != want {
			t.Errorf("Sprintf(%q) = %s; want %s", verb, got, want)
		}
	}
	j, err := json.Marshal(cred)
	must(t, err)
	wantJSON := `{"jti":"j1","family":"refund_order:t_acme:4","scope":"tool::refund_order","expires_at":"2026-01-02T03:04:05Z","token":"[redacted]"}`
	if string(j) != wantJSON {
		t.Errorf("json.Marshal = %s; want %s", j, wantJSON)
	}
}
