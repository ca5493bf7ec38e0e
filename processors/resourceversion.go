package processors

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/schemas"
)

// ErrVersionURL: a tool's resource_version URL cannot be asked (a
// relative URL without a base URL, say): a read will not succeed later.
var ErrVersionURL = errors.New("resource version url")

// VersionReader reads a resource's version (httptool.Client does).
type VersionReader interface {
	ResourceVersion(ctx context.Context, versionURL, resource, tenant string) (string, error)
}

// ResourceVersion reads the version of the resource that a call of tool
// with arguments args names, from tool's version endpoint (registry
// resource_version; a relative URL resolves against base, nil for none)
// within ctx: each caller bounds the read by what waits for it. declared
// is false, and nothing is read, when tool declares no version endpoint
// or resource, or args do not name one.
func ResourceVersion(ctx context.Context, r VersionReader, base *url.URL, tool *schemas.Tool, args any, tenant string) (v string, declared bool, err error) {
	if tool.ResourceVersion == nil || tool.Resource == "" {
		return "", false, nil
	}
	res, ok := ledger.ResourceOf(args, tool.Resource)
	if !ok {
		return "", false, nil
	}
	u, err := ResolveURL(base, tool.ResourceVersion.URL)
	if err != nil {
		return "", true, fmt.Errorf("%w: %w", ErrVersionURL, err)
	}
	v, err = r.ResourceVersion(ctx, u, res, tenant)
	return v, true, err
}

// VersionReadLater reports whether a failed read of a resource's version
// (ResourceVersion's error) may succeed later: no answer (or none
// readable), a 5xx, 408 or 429. Another 4xx (404: the resource is gone;
// 401, 403), a redirect (not followed: the URL moved) or a URL that
// cannot be asked will not change by waiting.
func VersionReadLater(err error) bool {
	if errors.Is(err, ErrVersionURL) || errors.Is(err, httptool.ErrInvalidRequest) {
		return false
	}
	if he, ok := errors.AsType[*httptool.Error](err); ok && he.Status >= 300 && he.Status < 500 {
		return he.Status == 408 || he.Status == 429 // request timeout, too many requests
	}
	return true
}

// ResolveURL resolves a registry URL against base: an absolute one stays
// as it is, a relative one needs base.
func ResolveURL(base *url.URL, raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", err
	}
	if u.IsAbs() {
		return raw, nil
	}
	if base == nil {
		return "", fmt.Errorf("relative url %q without a base url", raw)
	}
	return base.ResolveReference(u).String(), nil
}

// ParseBaseURL parses a --tools-base-url: "" is none (nil).
func ParseBaseURL(raw string) (*url.URL, error) {
	if raw == "" {
		return nil, nil
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("base url: %w", err)
	}
	return u, nil
}
