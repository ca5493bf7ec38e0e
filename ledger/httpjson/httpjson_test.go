package httpjson_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/httpjson"
)

// A request no route takes is answered in JSON, 404 or 405 with the Allow
// header; a route's own answers, its errors and mux's redirects pass as
// they are. Before, the APIs answered those with net/http's plain text.
func TestUnmatchedAnswersJSON(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/things/{id}", func(w http.ResponseWriter, r *http.Request) {
		if r.PathValue("id") == "missing" {
			http.Error(w, "a route's own not found", http.StatusNotFound)
			return
		}
		w.Write([]byte("thing"))
	})
	mux.HandleFunc("GET /v1/dir/", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("dir")) })
	h := httpjson.Unmatched(mux)
	for _, tc := range []struct {
		method, path string
		status       int
		code, allow  string // code: a JSON error's; empty: the body is body
		body         string
	}{
		{"GET", "/v1/nowhere", http.StatusNotFound, httpjson.CodeNoRoute, "", ""},
		{"DELETE", "/v1/things/1", http.StatusMethodNotAllowed, httpjson.CodeMethodNotAllowed, "GET, HEAD", ""},
		{"GET", "/v1/things/1", http.StatusOK, "", "", "thing"},
		{"GET", "/v1/things/missing", http.StatusNotFound, "", "", "a route's own not found\n"},
		{"GET", "/v1/dir", 0, "", "", ""}, // mux's redirect, as mux answers it
	} {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, nil))
		if tc.status == 0 {
			raw := httptest.NewRecorder()
			mux.ServeHTTP(raw, httptest.NewRequest(tc.method, tc.path, nil))
			if rec.Code != raw.Code || rec.Header().Get("Location") != raw.Header().Get("Location") || rec.Code/100 != 3 {
				t.Errorf("%s %s: %d to %q; want mux's redirect, %d to %q", tc.method, tc.path, rec.Code, rec.Header().Get("Location"), raw.Code, raw.Header().Get("Location"))
			}
			continue
		}
		if rec.Code != tc.status {
			t.Errorf("%s %s: %d; want %d", tc.method, tc.path, rec.Code, tc.status)
			continue
		}
		if got := rec.Header().Get("Allow"); got != tc.allow {
			t.Errorf("%s %s: Allow %q; want %q", tc.method, tc.path, got, tc.allow)
		}
		if tc.code == "" {
			if tc.body != "" && rec.Body.String() != tc.body {
				t.Errorf("%s %s: body %q; want %q, as the route wrote it", tc.method, tc.path, rec.Body.String(), tc.body)
			}
			continue
		}
		var e struct {
			Error struct{ Code, Message string } `json:"error"`
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s %s: Content-Type %q; want application/json", tc.method, tc.path, ct)
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error.Code != tc.code || e.Error.Message == "" {
			t.Errorf("%s %s: body %q (%v); want a JSON error %s with a message", tc.method, tc.path, rec.Body.String(), err, tc.code)
		}
	}
}

// A body's read error is named by what happened to the transfer, never by
// its own text, which names the server's address: a read past the
// server's deadline is a timeout (sent again, it may pass), a connection
// lost or a body shorter than promised broke off, and a content error is
// none of these.
func TestBodyReadError(t *testing.T) {
	opErr := func(err error) error {
		return &net.OpError{Op: "read", Net: "tcp", Source: &net.TCPAddr{IP: net.IPv4(10, 0, 3, 7), Port: 8080}, Err: err}
	}
	for _, c := range []struct {
		name string
		err  error
		want error
	}{
		{"deadline", opErr(os.ErrDeadlineExceeded), httpjson.ErrBodyTimeout},
		{"connection reset", opErr(syscall.ECONNRESET), httpjson.ErrBodyBroken},
		{"shorter than promised, or JSON that ends mid-value", fmt.Errorf("read body: %w", io.ErrUnexpectedEOF), nil},
		{"content", errors.New("invalid character 'x' looking for beginning of value"), nil},
	} {
		if got := httpjson.BodyReadError(c.err); got != c.want {
			t.Errorf("%s: httpjson.BodyReadError(%v) = %v; want %v", c.name, c.err, got, c.want)
		}
	}
}

// Retry-After is whole seconds, never sooner than asked, and at least 1.
func TestSetRetryAfter(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0: "1", -time.Second: "1", time.Millisecond: "1", time.Second: "1",
		1500 * time.Millisecond: "2", 30 * time.Second: "30", 41500 * time.Millisecond: "42",
	} {
		w := httptest.NewRecorder()
		httpjson.SetRetryAfter(w, d)
		if got := w.Header().Get("Retry-After"); got != want {
			t.Errorf("SetRetryAfter(%v) = %q; want %q", d, got, want)
		}
	}
}
