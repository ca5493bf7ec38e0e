package httpapi

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
)

// AgentClient submits envelopes to a ledger's API and reads their calls
// back, as an agent does: with the agent's identity assertion as the
// bearer. It needs no access to Kafka, so that agents of a shared
// deployment need no Read on the events topic (every tenant's history).
type AgentClient struct {
	// Base is the API's address, such as https://ledger.example.com.
	Base string
	// HTTP is the client; default http.DefaultClient. Its timeout must
	// exceed the waits asked for. Redirects are not followed, whatever
	// it says: the request carries the agent's assertion, which a
	// redirect would send on, to another scheme or (with the envelope)
	// another host.
	HTTP *http.Client
}

// APIError is an error answer of the API: its status and its
// machine-readable code, which callers branch on.
type APIError struct {
	Status  int    // the HTTP status
	Code    string // the error's code ("not_found", "tenant_mismatch"...)
	Message string // for humans
	Pointer string // the JSON pointer of the offending member, if any
}

// decodeAPIError is the API's error answer raw, under status: its code
// unexpected_answer when raw is not one.
func decodeAPIError(status int, raw []byte) *APIError {
	var e struct {
		Error apiError `json:"error"`
	}
	if json.Unmarshal(raw, &e) != nil || e.Error.Code == "" {
		return &APIError{Status: status, Code: "unexpected_answer", Message: http.StatusText(status)}
	}
	return &APIError{Status: status, Code: e.Error.Code, Message: e.Error.Message, Pointer: e.Error.Pointer}
}

func (e *APIError) Error() string {
	if e.Pointer != "" {
		return fmt.Sprintf("%d %s at %s: %s", e.Status, e.Code, e.Pointer, e.Message)
	}
	return fmt.Sprintf("%d %s: %s", e.Status, e.Code, e.Message)
}

// IsNotFound reports whether err is the API's answer that no call is
// under a key (yet: the API lags the log by the projection's delay).
func IsNotFound(err error) bool {
	var e *APIError
	return errors.As(err, &e) && e.Status == http.StatusNotFound && e.Code == "not_found"
}

// Submit posts envelope, with bearer (an agent's identity assertion; ""
// for none) as its Authorization. With wait > 0 the API answers once the
// call settled or this submission was refused (view.Refused), waiting at
// most wait and its own bound: answered says whether it did, and view is
// then the call. Without, the envelope is published and nothing is
// waited for.
func (c *AgentClient) Submit(ctx context.Context, envelope []byte, bearer string, wait time.Duration) (view CallView, answered bool, err error) {
	path := "/v1/calls"
	if wait > 0 {
		path += "?wait=" + url.QueryEscape(wait.String())
	}
	status, err := c.do(ctx, http.MethodPost, path, bearer, envelope, &view)
	return view, err == nil && status == http.StatusOK, err
}

// Call reads the call under key, which must be of the bearer's tenant
// (an API without agents' authentication, ledger dev's, takes the tenant
// from key).
func (c *AgentClient) Call(ctx context.Context, key ledger.CallKey, bearer string) (CallView, error) {
	var view CallView
	path := "/v1/calls/" + url.PathEscape(key.IdempotencyKey) + "?tenant_id=" + url.QueryEscape(key.TenantID)
	_, err := c.do(ctx, http.MethodGet, path, bearer, nil, &view)
	return view, err
}

// IsTransient reports whether err, from Submit or Call, may pass if asked
// again: the network, a busy API (429), a request that arrived too slowly
// (408) or a server error; not a refusal
// of the request itself (400, 401, 403, 404), an answer that does not
// decode, or a server certificate that does not verify.
func IsTransient(err error) bool {
	var e *APIError
	if errors.As(err, &e) {
		return e.Status == http.StatusTooManyRequests || e.Status == http.StatusRequestTimeout || e.Status >= 500
	}
	var unverified *tls.CertificateVerificationError
	var hostname x509.HostnameError
	var authority x509.UnknownAuthorityError
	if errors.As(err, &unverified) || errors.As(err, &hostname) || errors.As(err, &authority) {
		return false
	}
	return err != nil
}

// do sends the request and decodes a 200's answer into into; an error
// answer comes back as an *APIError.
func (c *AgentClient) do(ctx context.Context, method, path, bearer string, body []byte, into any) (int, error) {
	status, raw, err := roundTrip(ctx, c.HTTP, method, strings.TrimSuffix(c.Base, "/")+path, bearer, body, 64<<20)
	if err != nil {
		return 0, fmt.Errorf("%s %s: %w", method, path, err)
	}
	switch status {
	case http.StatusOK:
		if err := json.Unmarshal(raw, into); err != nil {
			return 0, &APIError{Status: status, Code: "undecodable_answer", Message: "the answer does not decode: " + err.Error()}
		}
		return status, nil
	case http.StatusAccepted:
		return status, nil
	}
	return 0, decodeAPIError(status, raw)
}
