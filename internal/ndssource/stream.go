package ndssource

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	nds "istio.io/istio/pkg/dns/proto"
)

// maxMessage bounds one xDS response: a NameTable of 100k Services is
// about 10 MB, over gRPC's 4 MB default.
const maxMessage = 256 << 20

func splitHostPort(addr string) (host, port string, err error) {
	host, port, err = net.SplitHostPort(addr)
	if err != nil {
		return "", "", err
	}
	if host == "" || port == "" {
		return "", "", errors.New("want HOST:PORT")
	}
	return host, port, nil
}

// dial makes the gRPC client connection all views share. It connects
// lazily: an unreachable istiod shows in the streams, not here.
func (s *Source) dial() (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if s.cfg.CAFile != "" {
		pem, err := os.ReadFile(s.cfg.CAFile)
		if err != nil {
			return nil, fmt.Errorf("--istiod-ca-file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--istiod-ca-file %s: no PEM certificate in it", s.cfg.CAFile)
		}
		creds = credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: s.cfg.SAN, MinVersion: tls.VersionTLS12})
	}
	conn, err := grpc.NewClient(s.cfg.Addr,
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessage)),
		// istiod's enforcement allows pings every 15 s at most.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		grpc.WithUserAgent("meshdns-ebpf"),
	)
	if err != nil {
		return nil, fmt.Errorf("istiod %s: %w", s.cfg.Addr, err)
	}
	return conn, nil
}

// node is the proxy istiod computes the view of namespace ns for: a
// sidecar of that namespace with DNS capture and VIP auto-allocation on,
// as the Istio agent describes a sidecar whose DNS it captures.
func (s *Source) node(ns string) *core.Node {
	ips := make([]string, 0, len(s.cfg.ProxyIPs))
	for _, a := range s.cfg.ProxyIPs {
		ips = append(ips, a.String())
	}
	first := "127.0.0.1"
	if len(ips) > 0 {
		first = ips[0]
	}
	md := map[string]any{
		"NAMESPACE":         ns,
		"CLUSTER_ID":        s.cfg.ClusterID,
		"DNS_CAPTURE":       "true",
		"DNS_AUTO_ALLOCATE": "true",
		"DNS_DOMAIN":        ns + ".svc." + s.domain,
		"INSTANCE_IPS":      strings.Join(ips, ","),
		"WORKLOAD_NAME":     s.cfg.ProxyName,
	}
	st, _ := structpb.NewStruct(md) // strings only: cannot fail
	return &core.Node{
		Id:       "sidecar~" + first + "~" + s.ProxyID(ns) + "~" + ns + ".svc." + s.domain,
		Cluster:  s.cfg.ProxyName + "." + ns,
		Metadata: st,
	}
}

// stream keeps the view of ns subscribed until ctx ends: a session per
// connection, reconnecting with backoff (reset once a session received a
// table).
func (s *Source) stream(ctx context.Context, conn *grpc.ClientConn, ns string, gen int, events chan<- event) {
	delay := s.cfg.MinBackoff
	for {
		got, err := s.session(ctx, conn, ns, gen, events)
		if ctx.Err() != nil {
			return
		}
		select {
		case events <- event{ns: ns, gen: gen, err: err}:
		case <-ctx.Done():
			return
		}
		if got {
			delay = s.cfg.MinBackoff
		}
		// Jitter: the views (and the nodes) do not reconnect in step.
		wait := delay/2 + rand.N(delay/2+1)
		s.log.Debug("istiod stream down, reconnecting", "view", ns, "in", wait, "err", err)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		delay = min(2*delay, s.cfg.MaxBackoff)
	}
}

// session is one ADS stream: the NDS request, then every table istiod
// pushes is handed to Run and acknowledged (or refused when it does not
// decode). got says whether a table arrived.
func (s *Source) session(ctx context.Context, conn *grpc.ClientConn, ns string, gen int, events chan<- event) (got bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if s.cfg.TokenFile != "" {
		tok, err := os.ReadFile(s.cfg.TokenFile)
		if err != nil {
			return false, fmt.Errorf("--istiod-token-file: %w", err)
		}
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+strings.TrimSpace(string(tok)))
	}
	ads, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		return false, fmt.Errorf("istiod %s: %w", s.cfg.Addr, err)
	}
	if err := ads.Send(&discovery.DiscoveryRequest{Node: s.node(ns), TypeUrl: NameTableType}); err != nil {
		return false, fmt.Errorf("istiod %s: send the NDS request: %w", s.cfg.Addr, recvErr(ads, err))
	}
	for {
		resp, err := ads.Recv()
		if err != nil {
			return got, fmt.Errorf("istiod %s: %w", s.cfg.Addr, err)
		}
		ack := &discovery.DiscoveryRequest{TypeUrl: resp.GetTypeUrl(), VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}
		if resp.GetTypeUrl() == NameTableType && len(resp.GetResources()) > 0 {
			nt := &nds.NameTable{}
			if err := resp.GetResources()[0].UnmarshalTo(nt); err != nil {
				s.log.Error("istiod sent a name table that does not decode", "view", ns, "err", err)
				ack.ErrorDetail = &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: err.Error()}
			} else {
				got = true
				select {
				case events <- event{ns: ns, gen: gen, table: nt}:
				case <-ctx.Done():
					return got, ctx.Err()
				}
			}
		}
		if err := ads.Send(ack); err != nil {
			return got, fmt.Errorf("istiod %s: acknowledge: %w", s.cfg.Addr, recvErr(ads, err))
		}
	}
}

// recvErr gives the stream's real error when a Send fails with io.EOF
// (gRPC reports the status only to Recv).
func recvErr(ads discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient, err error) error {
	if _, rerr := ads.Recv(); rerr != nil {
		return rerr
	}
	return err
}
