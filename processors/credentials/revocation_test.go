package credentials

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
)

// introspection is an RFC 7662 endpoint answering answer to every
// question, recording the tokens it was asked about.
type introspection struct {
	status int
	answer string
	asked  atomic.Int64
	tokens chan string
}

func (i *introspection) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	i.asked.Add(1)
	b, _ := io.ReadAll(r.Body)
	form, _ := url.ParseQuery(string(b))
	select {
	case i.tokens <- form.Get("token") + "|" + r.URL.RawQuery + "|" + form.Get(FormVerified):
	default:
	}
	w.WriteHeader(i.status)
	io.WriteString(w, i.answer)
}

// A Verifier with Revocations refuses a credential the ledger revoked,
// refuses as unknown one whose status cannot be found out, and asks only
// about credentials that pass every other check. Before, a backend built
// on the library honoured a revoked credential until it expired unless it
// asked the ledger itself.
func TestVerifyAsksRevocations(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		status int
		answer string
		want   Reason // "": accepted
	}{
		{"active", 200, `{"active": true, "jti": "x"}`, ""},
		{"revoked", 200, `{"active": false}`, ReasonRevoked},
		{"endpoint failing", 503, `{"error": "unavailable"}`, ReasonRevocationUnavailable},
		{"answer without active", 200, `{}`, ReasonRevocationUnavailable},
		{"answer not JSON", 200, `active`, ReasonRevocationUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ep := &introspection{status: tc.status, answer: tc.answer, tokens: make(chan string, 1)}
			srv := httptest.NewServer(ep)
			t.Cleanup(srv.Close)
			c := newClock()
			b := newBroker(t, c, Config{})
			v := newVerifier(t, c, b, VerifierConfig{Revocations: &Introspector{URL: srv.URL, Client: srv.Client()}})
			tok := mint(t, b, grant()).Token
			_, err := v.Verify(t.Context(), tok, expect())
			if got := ReasonOf(err); got != tc.want {
				t.Fatalf("Verify: %v; want reason %q", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), tok) {
				t.Errorf("the refusal quotes the token: %v", err)
			}
			// And that its signature was verified: the ledger then
			// answers a key it does not know 503, not inactive.
			if got := <-ep.tokens; got != tok+"||true" {
				t.Errorf("asked about %q (token|query|verified); want the token in the form body only, said verified", got)
			}
			// A credential refused by an earlier check is not asked about.
			if _, err := v.Verify(t.Context(), tok, Expect{Scope: "tool::other", Tenant: "t_acme", IdempotencyKey: expect().IdempotencyKey}); err == nil {
				t.Fatal("Verify with another scope accepted the credential")
			}
			if n := ep.asked.Load(); n != 1 {
				t.Errorf("introspection asked %d times; want once, not for a credential refused before", n)
			}
		})
	}
}

// A Revocations that fails is the refusal's cause.
func TestVerifyRevocationsErrorIsTheCause(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	cause := errors.New("control plane unreachable")
	v := newVerifier(t, c, b, VerifierConfig{Revocations: failingRevocations{cause}})
	_, err := v.Verify(t.Context(), mint(t, b, grant()).Token, expect())
	if ReasonOf(err) != ReasonRevocationUnavailable || !errors.Is(err, cause) {
		t.Errorf("Verify: %v; want %s caused by %v", err, ReasonRevocationUnavailable, cause)
	}
}

type failingRevocations struct{ err error }

func (f failingRevocations) Active(context.Context, string) (bool, error) { return false, f.err }

// An Introspector asks only over https, or http on loopback: an answer
// read in clear over a network could be forged to undo a revocation. Its
// errors never quote the URL, whose query may carry a credential.
func TestIntrospectorURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url      string
		insecure bool
		ok       bool
	}{
		{"https://reconciler.ledger:8443/v1/introspect", false, true},
		{"http://127.0.0.1:8090/v1/introspect", false, true},
		{"http://reconciler.ledger:8090/v1/introspect?key=s3cret", false, false},
		{"http://reconciler.ledger:8090/v1/introspect", true, true},
		{"ftp://reconciler.ledger/x", false, false},
		{"", false, false},
	} {
		i := &Introspector{URL: tc.url, AllowInsecureHTTP: tc.insecure}
		err := i.Check()
		if (err == nil) != tc.ok {
			t.Errorf("Check(%q, insecure %v) = %v; want ok %v", tc.url, tc.insecure, err, tc.ok)
		}
		if err != nil && tc.url != "" && strings.Contains(err.Error(), tc.url) {
			t.Errorf("Check(%q) quotes the URL: %v", tc.url, err)
		}
	}
	// A failed request names neither the URL nor its query.
	i := &Introspector{URL: "http://127.0.0.1:1/v1/introspect?key=s3cret"}
	if _, err := i.Active(t.Context(), "tok"); err == nil || strings.Contains(err.Error(), "s3cret") || strings.Contains(err.Error(), "tok") {
		t.Errorf("Active against nothing listening: %v; want an error without the URL's query or the token", err)
	}
}

// A Verifier whose Introspector's URL is wrong is refused at the start,
// not at the first credential; an introspection answered with a redirect
// is not followed to a target never checked.
func TestIntrospectorCheckedAndNotRedirected(t *testing.T) {
	t.Parallel()
	c := newClock()
	b := newBroker(t, c, Config{})
	_, err := NewVerifier(VerifierConfig{Audience: "demo-backend", Keys: b.Keys, Now: c.Now,
		Revocations: &Introspector{URL: "http://reconciler.ledger:8090/v1/introspect"}})
	if !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("NewVerifier with an http introspection URL off loopback: %v; want ErrInvalidConfig", err)
	}
	elsewhere := &introspection{status: 200, answer: `{"active": true}`, tokens: make(chan string, 1)}
	target := httptest.NewServer(elsewhere)
	t.Cleanup(target.Close)
	redirect := httptest.NewServer(http.RedirectHandler(target.URL, http.StatusTemporaryRedirect))
	t.Cleanup(redirect.Close)
	v := newVerifier(t, c, b, VerifierConfig{Revocations: &Introspector{URL: redirect.URL, Client: redirect.Client()}})
	if _, err := v.Verify(t.Context(), mint(t, b, grant()).Token, expect()); ReasonOf(err) != ReasonRevocationUnavailable {
		t.Errorf("Verify with the introspection answered by a redirect: %v; want %s", err, ReasonRevocationUnavailable)
	}
	if n := elsewhere.asked.Load(); n != 0 {
		t.Errorf("the redirect's target was asked %d times; want never", n)
	}
}
