package token

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"
)

// Claims are the registered claims of RFC 7519 §4.1. Embed Claims in a
// struct to add private claims; encoding/json promotes its fields.
type Claims struct {
	Issuer    string       `json:"iss,omitempty"`
	Subject   string       `json:"sub,omitempty"`
	Audience  Audience     `json:"aud,omitempty"`
	ExpiresAt *NumericDate `json:"exp,omitempty"`
	NotBefore *NumericDate `json:"nbf,omitempty"`
	IssuedAt  *NumericDate `json:"iat,omitempty"`
	ID        string       `json:"jti,omitempty"`
}

// Validate checks the time and addressing claims at now: exp is required
// and must be after now - skew; nbf and iat, when present, must not be
// after now + skew; iss must equal issuer exactly; aud must contain
// audience. An empty issuer or audience matches nothing, so a
// misconfigured caller fails closed. Errors are *Error.
func (c Claims) Validate(now time.Time, skew time.Duration, issuer, audience string) error {
	if issuer == "" || c.Issuer != issuer {
		return fail(ReasonIssuerMismatch, "iss is not the expected issuer")
	}
	if audience == "" || !slices.Contains(c.Audience, audience) {
		return fail(ReasonAudienceMismatch, "aud does not contain %s", audience)
	}
	if c.ExpiresAt == nil {
		return fail(ReasonMissingClaim, "no exp")
	}
	if !now.Before(c.ExpiresAt.Add(skew)) {
		return fail(ReasonExpired, "expired at %s", c.ExpiresAt.UTC().Format(time.RFC3339))
	}
	if c.NotBefore != nil && c.NotBefore.After(now.Add(skew)) {
		return fail(ReasonNotYetValid, "nbf %s is in the future", c.NotBefore.UTC().Format(time.RFC3339))
	}
	if c.IssuedAt != nil && c.IssuedAt.After(now.Add(skew)) {
		return fail(ReasonNotYetValid, "iat %s is in the future", c.IssuedAt.UTC().Format(time.RFC3339))
	}
	return nil
}

// Audience is the aud claim: one string or an array of strings in JSON
// (RFC 7519 §4.1.3). It marshals a single audience as a string.
type Audience []string

// MarshalJSON writes one audience as a string, several as an array.
func (a Audience) MarshalJSON() ([]byte, error) {
	if len(a) == 1 {
		return json.Marshal(a[0])
	}
	return json.Marshal([]string(a))
}

// UnmarshalJSON accepts a string or an array of strings.
func (a *Audience) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*a = Audience{s}
		return nil
	}
	var list []string
	if err := json.Unmarshal(b, &list); err != nil {
		return fmt.Errorf("aud: want a string or an array of strings")
	}
	*a = list
	return nil
}

// NumericDate is a JWT time: seconds since the epoch in JSON (RFC 7519 §2),
// fractions accepted on input.
type NumericDate struct {
	time.Time
}

// maxNumericDate is 9999-12-31T23:59:59Z: later dates are refused rather
// than overflowing.
const maxNumericDate = 253402300799

// NewNumericDate returns t truncated to the second.
func NewNumericDate(t time.Time) *NumericDate {
	return &NumericDate{Time: t.Truncate(time.Second)}
}

// MarshalJSON writes whole seconds since the epoch.
func (d NumericDate) MarshalJSON() ([]byte, error) {
	return strconv.AppendInt(nil, d.Unix(), 10), nil
}

// UnmarshalJSON reads a JSON number of seconds since the epoch, between 0
// and year 9999.
func (d *NumericDate) UnmarshalJSON(b []byte) error {
	s := string(bytes.TrimSpace(b))
	if s == "null" {
		return nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || len(s) == 0 || s[0] == '"' || math.IsNaN(f) || f < 0 || f > maxNumericDate {
		return fmt.Errorf("numeric date: want seconds since the epoch")
	}
	sec, frac := math.Modf(f)
	d.Time = time.Unix(int64(sec), int64(frac*1e9)).UTC()
	return nil
}
