package demobackend

import (
	"crypto/subtle"
	"net/http"
	"strconv"
	"strings"

	"github.com/toolcall-ledger/ledger/processors/credentials"
)

// Refusal is a tool request or status lookup refused for its credential
// (Config.Credentials). Nothing was applied.
type Refusal struct {
	Tool           string             `json:"tool"`
	Reason         credentials.Reason `json:"reason"`
	TenantID       string             `json:"tenant_id,omitempty"`
	IdempotencyKey string             `json:"idempotency_key,omitempty"`
	// Lookup: the refused request was a status lookup.
	Lookup bool `json:"lookup,omitempty"`
}

// refuse records a refused request.
func (s *Server) refuse(r Refusal) {
	s.mu.Lock()
	s.refusals = append(s.refusals, r)
	s.mu.Unlock()
}

// backendSecretOK checks the long-lived secret tool demands of every
// request, its calls' and its status lookups' (Config.BackendSecrets);
// it refuses a request without it (401) and records the Refusal.
func (s *Server) backendSecretOK(w http.ResponseWriter, r *http.Request, tool, tenant, key string) bool {
	want, ok := s.backendSecrets[tool]
	if !ok || subtle.ConstantTimeCompare([]byte(r.Header.Get(httpHeaderBackendSecret)), []byte(want)) == 1 {
		return true
	}
	s.refuse(Refusal{Tool: tool, Reason: ReasonBackendSecret, TenantID: tenant, IdempotencyKey: key, Lookup: r.Method == http.MethodGet})
	writeError(w, http.StatusUnauthorized, string(ReasonBackendSecret), "the backend secret is missing or wrong")
	return false
}

// authorize verifies the request's credential for tool (its action, or
// for a GET its status lookup: a lookup's credential does not authorize
// the action), tenant and the call key, and returns its claims (bodyOK
// checks the body against them once read). On refusal it answers the
// request (401, or 503 when the keys are unavailable), records the
// Refusal and returns false. Without a verifier every request is
// authorized, with no claims.
func (s *Server) authorize(w http.ResponseWriter, r *http.Request, tool, tenant, key string) (credentials.Claims, bool) {
	if s.verifier == nil {
		return credentials.Claims{}, true
	}
	lookup := r.Method == http.MethodGet
	verify := func(scope string) (credentials.Claims, error) {
		return s.verifier.Verify(r.Context(), bearerToken(r.Header), credentials.Expect{
			Scope:          scope,
			Tenant:         tenant,
			IdempotencyKey: key,
			Audience:       s.audience,
		})
	}
	// The action needs the action's scope. A lookup takes the lookup's
	// scope, or the action's: who may do a call may read what it did.
	scope := credentials.ToolScope(tool)
	if lookup {
		scope = credentials.StatusScope(tool)
	}
	claims, err := verify(scope)
	if lookup && credentials.ReasonOf(err) == credentials.ReasonWrongScope {
		claims, err = verify(credentials.ToolScope(tool))
	}
	if err == nil {
		// The verifier is the caller's, shared: revocations are asked
		// here, as a Verifier with Revocations would ask them.
		err = credentials.CheckRevoked(r.Context(), s.revocations, bearerToken(r.Header))
		if credentials.ReasonOf(err) == credentials.ReasonRevocationUnavailable {
			s.logger.Warn("introspection unavailable", "err", err)
			w.Header().Set(HeaderNotApplied, "true")
			writeError(w, http.StatusServiceUnavailable, string(credentials.ReasonRevocationUnavailable), "the credential's status cannot be checked")
			return credentials.Claims{}, false
		}
	}
	if err == nil {
		return claims, true
	}
	s.refuseCredential(w, tool, tenant, key, lookup, err)
	return credentials.Claims{}, false
}

// bodyOK checks that the body read is the one claims' credential was
// minted for (credentials.Claims.CheckBody); on refusal it answers and
// records it as authorize does.
func (s *Server) bodyOK(w http.ResponseWriter, claims credentials.Claims, body []byte, tool, tenant, key string) bool {
	if err := claims.CheckBody(body); err != nil {
		s.refuseCredential(w, tool, tenant, key, false, err)
		return false
	}
	return true
}

// refuseCredential answers a request whose credential err refused (401,
// or 503 when the keys are unavailable) and records the Refusal.
func (s *Server) refuseCredential(w http.ResponseWriter, tool, tenant, key string, lookup bool, err error) {
	reason := credentials.ReasonOf(err)
	if reason == "" {
		// Verify returns only *credentials.Error; refuse anything else
		// all the same.
		reason = credentials.ReasonMalformed
	}
	s.refuse(Refusal{Tool: tool, Reason: reason, TenantID: tenant, IdempotencyKey: key, Lookup: lookup})
	s.logger.Debug("credential refused", "tool", tool, "tenant_id", tenant, "idempotency_key", key, "lookup", lookup, "reason", string(reason))

	status := http.StatusUnauthorized
	if reason == credentials.ReasonKeysUnavailable {
		status = http.StatusServiceUnavailable
		w.Header().Set(HeaderNotApplied, "true")
	} else {
		// RFC 6750 §3: tell the client which scheme, and that the token
		// (if any) was not good.
		challenge := "Bearer realm=" + strconv.Quote(s.audience)
		if reason != credentials.ReasonMissingToken {
			challenge += `, error="invalid_token"`
		}
		w.Header().Set("WWW-Authenticate", challenge)
	}
	// The error text never quotes the token (credentials' contract).
	writeError(w, status, string(reason), err.Error())
}

// bearerToken returns the token of an "Authorization: Bearer <token>"
// header (the scheme is case-insensitive, RFC 7235), or "" if there is
// none. Two Authorization headers are ambiguous and count as none.
func bearerToken(h http.Header) string {
	values := h.Values("Authorization")
	if len(values) != 1 {
		return ""
	}
	scheme, token, ok := strings.Cut(values[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(token)
}

// Refusals returns a copy of every refusal so far, in order.
func (s *Server) Refusals() []Refusal {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Refusal, len(s.refusals))
	copy(out, s.refusals)
	return out
}

// ReasonRevoked: the ledger's introspection endpoint says the credential
// is no longer active (credentials.ReasonRevoked).
const ReasonRevoked = credentials.ReasonRevoked

// ReasonBackendSecret: the request lacks the tool's backend secret.
const ReasonBackendSecret credentials.Reason = "backend_secret"

// httpHeaderBackendSecret is where the ledger's adapter sends a backend
// secret (httptool.HeaderBackendSecret; the backend does not import the
// adapter).
const httpHeaderBackendSecret = "X-Backend-Secret"
