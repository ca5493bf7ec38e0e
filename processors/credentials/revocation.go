package credentials

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
)

// Reasons of a Verifier with Revocations.
const (
	// ReasonRevoked: the credential verifies, but the ledger's control
	// plane revoked it (or its family): a kill switch.
	ReasonRevoked Reason = "revoked"
	// ReasonRevocationUnavailable: whether the credential was revoked
	// cannot be found out. Not the presenter's fault, and nothing may be
	// done on it: a tool answers 503, with X-Ledger-Not-Applied: true
	// (see ReasonKeysUnavailable).
	ReasonRevocationUnavailable Reason = "introspection_unavailable"
)

// Revocations says whether a credential that verified is still active:
// the ledger's introspection endpoint (Introspector), or anything else
// that follows the control plane's revocations. Implementations are safe
// for concurrent use.
type Revocations interface {
	Active(ctx context.Context, token string) (bool, error)
}

// Introspector asks an RFC 7662 token introspection endpoint (the ledger's
// /v1/introspect) whether a credential is active. The token goes in the
// form body, never in the URL or an error.
type Introspector struct {
	// URL is the endpoint: https, or http on a loopback address unless
	// AllowInsecureHTTP is set (an answer read in clear over a network
	// can be forged, undoing the kill switch). Required.
	URL string
	// AllowInsecureHTTP permits an http URL off loopback.
	AllowInsecureHTTP bool
	// Client reaches it. Default: http.DefaultClient, which has no
	// timeout and keeps two idle connections: give one with a timeout,
	// and a pool as large as the requests in flight.
	Client *http.Client
}

// Check says what is wrong with the Introspector's URL, without quoting
// it; Active refuses to ask (an error) while it is wrong.
func (i *Introspector) Check() error {
	if err := CheckURL(i.URL, i.AllowInsecureHTTP); err != nil {
		return fmt.Errorf("introspection URL %v", err)
	}
	return nil
}

// FormVerified is the introspection form's parameter by which a caller
// says it verified the token's signature itself ("true"), as
// Introspector does (CheckRevoked asks about a verified credential only).
// The ledger's endpoint then answers a kid it does not know 503, not
// inactive: its key sets lag the caller's, and "inactive" would read as a
// revocation.
const FormVerified = "ledger_signature_verified"

// maxIntrospection bounds an introspection answer read.
const maxIntrospection = 64 << 10

// Active implements Revocations.
func (i *Introspector) Active(ctx context.Context, token string) (bool, error) {
	if err := i.Check(); err != nil {
		return false, err
	}
	client := http.DefaultClient
	if i.Client != nil {
		client = i.Client
	}
	client = noRedirects(client)
	form := url.Values{"token": {token}, FormVerified: {"true"}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, i.URL, strings.NewReader(form.Encode()))
	if err != nil {
		return false, fmt.Errorf("introspection: %w", err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := client.Do(req)
	if err != nil {
		// Not the *url.Error itself: it quotes the URL, whose query may
		// carry a credential (the token is in the body, never in it).
		if ue, ok := errors.AsType[*url.Error](err); ok {
			err = ue.Err
		}
		return false, fmt.Errorf("introspection: %w", err)
	}
	defer func() {
		// Read to its end, so that the connection serves the next
		// introspection (a body closed early closes it).
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxIntrospection))
		resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Errorf("introspection answered %d", resp.StatusCode)
	}
	var out struct {
		Active *bool `json:"active"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxIntrospection)).Decode(&out); err != nil {
		return false, fmt.Errorf("introspection answer: %v", err)
	}
	if out.Active == nil {
		// RFC 7662 requires it: an answer without it says nothing.
		return false, fmt.Errorf("introspection answer without \"active\"")
	}
	return *out.Active, nil
}

// CheckRevoked asks r about a credential that passed every other check:
// nil when it is active (or r is nil), else an *Error, ReasonRevoked or,
// when r cannot answer, ReasonRevocationUnavailable. For a backend whose
// Verifier is shared without Revocations; a Verifier with them asks at
// the end of Verify.
func CheckRevoked(ctx context.Context, r Revocations, token string) error {
	if r == nil {
		return nil
	}
	active, err := r.Active(ctx, token)
	switch {
	case err != nil:
		return &Error{Reason: ReasonRevocationUnavailable, Detail: "whether the credential was revoked cannot be checked", Err: err}
	case !active:
		return reject(ReasonRevoked, "the credential was revoked")
	}
	return nil
}

// noRedirects is c, but answering a redirect with the redirect itself
// rather than following it: its target was never checked (CheckURL), and
// over it keys or answers could come from anywhere.
func noRedirects(c *http.Client) *http.Client {
	nc := *c
	nc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &nc
}
