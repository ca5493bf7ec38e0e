package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
)

// QueryClient asks a ledger's query API (QueryHandler) the projections'
// questions: it implements projections.Queries, so a CLI asks the same
// way whether it reads ClickHouse itself or goes through a ledger.
type QueryClient struct {
	// Base is the API's address, such as http://127.0.0.1:8080.
	Base string
	// Bearer returns the operator's assertion for a question about
	// tenant (PlatformTenant for one across tenants).
	Bearer func(tenant string) (string, error)
	// HTTP is the client; default http.DefaultClient.
	HTTP *http.Client
}

var _ projections.Queries = (*QueryClient)(nil)

// BlastRadius asks GET /v1/blast-radius.
func (c *QueryClient) BlastRadius(ctx context.Context, f projections.Filter) (projections.BlastRadius, error) {
	var br projections.BlastRadius
	if _, err := f.Check(); err != nil {
		return br, err
	}
	err := c.get(ctx, PathBlastRadius, f.Values(), scope(f), &br)
	return br, err
}

// Outcomes asks GET /v1/outcomes. A question over more than
// projections.MaxOutcomeBuckets buckets is refused before it is sent.
func (c *QueryClient) Outcomes(ctx context.Context, f projections.Filter, bucket time.Duration) ([]projections.OutcomeCount, error) {
	if _, err := projections.CheckOutcomes(f, bucket, time.Now()); err != nil {
		return nil, err
	}
	v := f.Values()
	v.Set(projections.ParamBucket, bucket.String())
	var out []projections.OutcomeCount
	err := c.get(ctx, PathOutcomes, v, scope(f), &out)
	return out, err
}

// Unresolved asks GET /v1/unresolved.
func (c *QueryClient) Unresolved(ctx context.Context, f projections.Filter) ([]projections.Call, error) {
	if _, err := projections.CheckUnresolved(f); err != nil {
		return nil, err
	}
	var out []projections.Call
	err := c.get(ctx, PathUnresolved, f.Values(), scope(f), &out)
	return out, err
}

// Trace asks GET /v1/trace/<tenant>/<key>.
func (c *QueryClient) Trace(ctx context.Context, key ledger.CallKey) ([]ledger.Event, error) {
	var out []ledger.Event
	path := PathTrace + url.PathEscape(key.TenantID) + "/" + url.PathEscape(key.IdempotencyKey)
	err := c.get(ctx, path, nil, key.TenantID, &out)
	return out, err
}

// scope is the tenant an assertion for f must be of.
func scope(f projections.Filter) string {
	if f.AllTenants {
		return PlatformTenant
	}
	return f.Tenant
}

// get asks path and decodes the answer into into; the API's error codes
// come back as the projections' errors they stand for.
func (c *QueryClient) get(ctx context.Context, path string, v url.Values, tenant string, into any) error {
	tok, err := c.Bearer(tenant)
	if err != nil {
		return err
	}
	u := strings.TrimSuffix(c.Base, "/") + path
	if len(v) > 0 {
		u += "?" + v.Encode()
	}
	status, raw, err := roundTrip(ctx, c.HTTP, http.MethodGet, u, tok, nil, 256<<20)
	if err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	if status != http.StatusOK {
		e := decodeAPIError(status, raw)
		switch e.Code {
		case "not_found":
			return fmt.Errorf("%w: %s", projections.ErrNotFound, e.Message)
		case "tenant_required":
			return projections.ErrTenantRequired
		case "invalid_filter":
			return fmt.Errorf("%w (%s)", projections.ErrInvalidFilter, e.Message)
		case "question_too_large":
			return projections.ErrQuestionTooLarge
		}
		return fmt.Errorf("GET %s: %w", path, e)
	}
	if err := json.Unmarshal(raw, into); err != nil {
		return fmt.Errorf("GET %s: the answer does not decode: %w", path, err)
	}
	return nil
}

// roundTrip sends body (nil: none) to u with bearer ("": none) as its
// Authorization, through hc (nil: http.DefaultClient), and reads at most
// limit bytes of the answer. Redirects are not followed, whatever hc
// does: the request carries an assertion (as the bearer, and in an
// envelope), which a redirect would send on, in clear or to another
// host; a 3xx comes back as it is.
func roundTrip(ctx context.Context, hc *http.Client, method, u, bearer string, body []byte, limit int64) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	if hc == nil {
		hc = http.DefaultClient
	}
	noRedirects := *hc
	noRedirects.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, err := noRedirects.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		return 0, nil, err
	}
	return resp.StatusCode, raw, nil
}
