package httptool

import (
	"strconv"
	"strings"
	"time"
)

// Kind sorts a failed call by what it proves about the side effect. It is
// the crux of the adapter: the executor turns it into a retry, a failed
// call, or an outcome_unknown call that the reconciler settles.
//
//	Kind         tool applied it?     retry with the same key is safe for
//	NotSent      no (provably)        every tool
//	Throttled    no                   every tool
//	Refused      no (this request)    nobody: the same call will be refused again
//	ServerError  maybe (it failed)    native tools only
//	Unknown      maybe                native tools only
//
// (The executor retries within the call's deadline, after its own
// backoff or the RetryAfter the tool asked for, whichever is longer; not
// at all when RetryAfter runs past the call's time. A tool that only
// reads is retried after any of them but Refused, and its call fails:
// there is no effect to be unsure of.)
//
// A refusal speaks for its own request only: after an earlier attempt
// under the same key that got no answer, the tool may have applied that
// one (and refuse this one before looking the key up).
type Kind int

// Kinds of Error.
const (
	// NotSent: the request provably never reached the tool whole. No
	// connection was ever handed to it (refused, DNS failure, dial
	// timeout, ctx done before sending), so not one of its bytes left the
	// process; or its Request.Gate held it back once the connection was
	// ready, when its headers (its credential and key among them) may have
	// gone, but not one byte of its body. Safe to retry for any tool.
	NotSent Kind = iota + 1
	// Unknown: the request may have been applied. A connection was handed
	// to it and then the exchange failed: a timeout or reset after (or
	// while) writing, an answer lost or cut short, a redirect. A native
	// tool may be retried with the same key (it dedupes); for a "none"
	// tool the call is outcome_unknown until reconciled.
	Unknown
	// Refused: the tool answered 4xx (other than 408 and 429): it refused
	// the call and applied nothing. Not retryable.
	Refused
	// Throttled: the tool answered 429, or a 5xx or 408 saying it applied
	// nothing (HeaderNotApplied): it asks for a later retry
	// (Error.RetryAfter, when it said).
	Throttled
	// ServerError: the tool answered 5xx, or 408: it says it failed, which
	// does not say the effect did not happen (it may have failed after
	// it, or a gateway in front of it lost its answer or timed it out:
	// a proxy's 408 may come after the tool got the whole request). A
	// native tool can be retried with the same key, whose replayed
	// answer settles the call; otherwise the executor treats it as
	// Unknown.
	ServerError
)

// String returns the kind in snake_case, fit for an event's error_code.
func (k Kind) String() string {
	switch k {
	case NotSent:
		return "not_sent"
	case Unknown:
		return "unknown"
	case Refused:
		return "refused"
	case Throttled:
		return "throttled"
	case ServerError:
		return "server_error"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Error is a failed tool call. Its message never contains the credential or
// a body (request or answer); the answer's body, when there was one, is in
// the Response returned beside it.
type Error struct {
	Kind Kind
	// Status is the tool's HTTP status; 0 when no answer arrived.
	Status int
	// RetryAfter is the tool's Retry-After on a Throttled or ServerError
	// answer; 0 when it gave none.
	RetryAfter time.Duration
	// Detail says what happened, in a few words of our own.
	Detail string
	// Err is the transport's error, if any: context.DeadlineExceeded and
	// context.Canceled are found through it with errors.Is.
	Err error
}

// Error describes the failure: kind, detail, status and cause.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("tool call ")
	b.WriteString(e.Kind.String())
	if e.Detail != "" {
		b.WriteString(": ")
		b.WriteString(e.Detail)
	}
	if e.Status != 0 {
		b.WriteString(": status ")
		b.WriteString(strconv.Itoa(e.Status))
	}
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

// Unwrap returns the transport's error.
func (e *Error) Unwrap() error { return e.Err }

// Retryable reports whether the call may be sent again whatever the tool's
// idempotency: the tool provably applied nothing (NotSent, Throttled).
func (e *Error) Retryable() bool {
	return e.Kind == NotSent || e.Kind == Throttled
}

// RetryableWithKey reports whether the call may be sent again to a tool with
// native idempotency, with the same idempotency key: anything but Refused,
// since such a tool applies a key at most once.
func (e *Error) RetryableWithKey() bool {
	return e.Kind != Refused
}

// MayHaveApplied reports whether, for a tool without idempotency, the effect
// may have happened (Unknown, ServerError): the call must not be retried
// blindly but reconciled.
func (e *Error) MayHaveApplied() bool {
	return e.Kind == Unknown || e.Kind == ServerError
}
