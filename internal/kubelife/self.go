package kubelife

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"k8s.io/client-go/rest"
)

// Self is the agent's own pod.
type Self struct {
	Namespace, Pod string
}

// FindSelf names the agent's pod: $POD_NAMESPACE and $POD_NAME when both are
// set (the downward API), else the claims of its service account token, which
// the kubelet binds to the pod it projects it into.
func FindSelf(rc *rest.Config) (Self, error) {
	if ns, pod := os.Getenv("POD_NAMESPACE"), os.Getenv("POD_NAME"); ns != "" && pod != "" {
		return Self{Namespace: ns, Pod: pod}, nil
	}
	token := rc.BearerToken
	if token == "" && rc.BearerTokenFile != "" {
		b, err := os.ReadFile(rc.BearerTokenFile)
		if err != nil {
			return Self{}, fmt.Errorf("read the service account token: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	if token == "" {
		return Self{}, errors.New("no $POD_NAME and $POD_NAMESPACE, and no service account token to read them from")
	}
	return selfFromToken(token)
}

// selfFromToken reads the pod a bound service account token names (its
// "kubernetes.io" claim). The signature is not checked: it is our own token,
// and the API server checks it on every request anyway.
func selfFromToken(token string) (Self, error) {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return Self{}, errors.New("the service account token is not a JWT")
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return Self{}, fmt.Errorf("service account token: %w", err)
	}
	var claims struct {
		K8s struct {
			Namespace string `json:"namespace"`
			Pod       struct {
				Name string `json:"name"`
			} `json:"pod"`
		} `json:"kubernetes.io"`
	}
	if err := json.Unmarshal(payload, &claims); err != nil {
		return Self{}, fmt.Errorf("service account token claims: %w", err)
	}
	if claims.K8s.Namespace == "" || claims.K8s.Pod.Name == "" {
		return Self{}, errors.New("the service account token is not bound to a pod (no kubernetes.io pod claim)")
	}
	return Self{Namespace: claims.K8s.Namespace, Pod: claims.K8s.Pod.Name}, nil
}
